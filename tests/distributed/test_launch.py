"""spawn / process groups: results come back, every failure becomes a clear error in bounded time,
and no process is left behind."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch
import torch.distributed as dist

from shrinkgrad.distributed import WorkerError, free_port, init_from_env, spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(60)]


def _sum_ranks(rank: int, world: int, scale: int) -> tuple[int, float]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank * scale, float(t)


def test_spawn_returns_every_rank_result_in_rank_order() -> None:
    out = spawn(_sum_ranks, 3, (10,))
    assert out == [(0, 3.0), (10, 3.0), (20, 3.0)]
    assert mp.active_children() == []


def _raise_on_rank1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def test_an_exception_names_its_rank_and_message() -> None:
    with pytest.raises(WorkerError) as info:
        spawn(_raise_on_rank1, 2)
    failures = info.value.failures
    assert [f.rank for f in failures] == [1]
    assert failures[0].message == "ValueError: boom on purpose"
    assert "raise ValueError" in failures[0].traceback
    assert "rank 1: ValueError: boom on purpose" in str(info.value)
    assert mp.active_children() == []


def _die_in_collective(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(0.5)
        os._exit(3)  # a crash: no exception, no goodbye
    t = torch.ones(4)
    dist.all_reduce(t)  # waits for rank 1, which dies


def test_a_dead_rank_makes_the_others_fail_quickly() -> None:
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        spawn(_die_in_collective, 3, pg_timeout=20.0)
    elapsed = time.monotonic() - t0
    by_rank = {f.rank: f for f in info.value.failures}
    assert by_rank[1].message == "exited with code 3 without a result"
    assert by_rank[1].exitcode == 3
    # the survivors' collectives fail on the closed connection, long before the 20 s timeout
    assert {0, 2} <= set(by_rank)
    assert all("Error" in by_rank[r].message for r in (0, 2))
    assert elapsed < 15.0
    assert mp.active_children() == []


def _stuck_rank(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(600)  # alive but never joins the collective
    t = torch.ones(4)
    dist.all_reduce(t)


def test_a_stuck_rank_hits_the_process_group_timeout_and_is_killed() -> None:
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        spawn(_stuck_rank, 2, pg_timeout=3.0, grace=2.0)
    elapsed = time.monotonic() - t0
    by_rank = {f.rank: f for f in info.value.failures}
    assert "RuntimeError" in by_rank[0].message  # gloo's timeout, raised on rank 0
    assert by_rank[1].message.startswith("did not stop within 2 s after rank 0 failed")
    assert 3.0 <= elapsed < 12.0
    assert mp.active_children() == []


def _sleep(rank: int, world: int) -> None:
    time.sleep(600)


def test_the_launch_timeout_kills_everything() -> None:
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="still running after the 2 s launch timeout"):
        spawn(_sleep, 2, timeout=2.0)
    assert time.monotonic() - t0 < 8.0
    assert mp.active_children() == []


def test_bad_arguments_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        spawn(_sleep, 0)
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
        spawn(_sleep, 1, timeout=-1)
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="not launched by torchrun"):
        init_from_env()
    port = free_port()
    assert isinstance(port, int) and 0 < port < 65536
