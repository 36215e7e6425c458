"""Shared setup of the distributed tests: import once what forked workers would import lazily."""

from __future__ import annotations

import pytest

from shrinkgrad.distributed import preload


@pytest.fixture(scope="session", autouse=True)
def _preload_for_fork() -> None:
    # DDP's constructor imports torch._dynamo (~2 s); forked ranks inherit it from here
    preload()
