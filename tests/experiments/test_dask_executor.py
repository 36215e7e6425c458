"""Sweeps on dask.distributed: a LocalCluster of 2 workers on 127.0.0.1 gives the local table bit
for bit, resumes and skips like a local sweep, and survives a worker killed mid-sweep."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from shrinkgrad.experiments.config import loads_config
from shrinkgrad.experiments.executors import make_executor
from shrinkgrad.experiments.grid import expand
from shrinkgrad.experiments.runner import run_experiment

# "dask.distributed", not "distributed": tests/distributed is importable by that name; and
# with dask but not distributed installed, "dask.distributed" imports that namespace package
# without error, so the test also asks for the client class itself
if not hasattr(pytest.importorskip("dask.distributed"), "Client"):
    pytest.skip("dask is installed without distributed", allow_module_level=True)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CONFIG = """
problem = "logistic_regression[dataset=a1a,n_clients=4]"
[run]
rounds = 1500
log_every = 100
checkpoint_every = 100
seeds = [0, 1]
[[pairs]]
method = "ef21"
compressors = ["top_k[k=1]", "top_k[k=2]"]
[[pairs]]
method = "dcgd"
compressor = "rand_k[k=3]"
stepsize = "1/L"
"""


def no_time(df: pd.DataFrame) -> pd.DataFrame:
    return df.drop(columns=["time_s"]).reset_index(drop=True)


class Recorder:
    def __init__(self, on_event: Any = None) -> None:
        self.events: list[tuple[str, str]] = []
        self.on_event = on_event

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def event(self, kind: str, run: Any, payload: dict[str, Any]) -> None:
        self.events.append((kind, run.run_id))
        if self.on_event is not None:
            self.on_event(kind, run, payload)


def test_the_executor_spec_uses_the_registry_grammar() -> None:
    ex = make_executor("dask[address=tcp://10.0.0.1:8786]")
    assert ex.describe() == "dask[address=tcp://10.0.0.1:8786]"
    assert make_executor("dask", jobs=3).describe().startswith("dask[workers=3]")
    with pytest.raises(ValueError, match="address must be a scheduler address"):
        make_executor("dask[address=somewhere]")
    with pytest.raises(ValueError, match="has no parameter 'adress'"):
        make_executor("dask[adress=tcp://h:1]")
    with pytest.raises(ValueError, match=r"unknown executor 'dusk'.*dask, local"):
        make_executor("dusk")


def test_a_local_cluster_sweep_equals_the_local_one_and_survives_a_killed_worker(
    tmp_path: Path,
) -> None:
    cfg = loads_config(CONFIG)
    local = run_experiment(cfg, tmp_path / "local", jobs=1, progress=False)
    executor = make_executor("dask[workers=2]")
    killed: list[int] = []

    def kill_one(kind: str, run: Any, payload: dict[str, Any]) -> None:
        # the first progress report: a run is in the middle of its rounds; kill its worker
        if kind == "progress" and not killed and payload.get("round", 0) >= 200:
            pids = executor.client.run(os.getpid)  # type: ignore[attr-defined]
            victim = next(iter(pids.values()))
            killed.append(victim)
            os.kill(victim, signal.SIGKILL)

    rec = Recorder(kill_one)
    res = run_experiment(cfg, tmp_path / "dask", executor=executor, display=rec)
    assert killed and res.complete and res.executor == "dask[workers=2] (LocalCluster on 127.0.0.1)"
    # every run is in the table once, and the table is the local one bit for bit
    assert sorted(r for k, r in rec.events if k == "done") == sorted(r.run_id for r in expand(cfg))
    pd.testing.assert_frame_equal(no_time(res.table), no_time(local.table), check_exact=True)
    # skip-finished behaves as locally
    again = run_experiment(cfg, tmp_path / "dask", executor="dask[workers=2]", progress=False)
    assert again.ran == 0 and again.skipped == len(expand(cfg))
