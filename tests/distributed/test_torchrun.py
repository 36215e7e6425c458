"""The real launcher: two ``torchrun`` agents on 127.0.0.1 as two "nodes" of two ranks each.

The other distributed tests set torchrun's variables themselves; this one starts
``python -m torch.distributed.run`` twice with a c10d rendezvous, so the global ranks, the
world size and the master address come from torch's own elastic agent, as on a two-host job
(one host here, so that nothing leaves the loopback). The run must write the same results
table as the simulator with the same config.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_train_cli import _compare, _write_config

from shrinkgrad.cli import main
from shrinkgrad.distributed import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def test_two_torchrun_agents_make_one_four_rank_job(tmp_path: Path) -> None:
    cfg = _write_config(tmp_path)
    cfg.write_text(cfg.read_text().replace("n_clients = 5", "n_clients = 4"), encoding="utf-8")
    main(["run", str(cfg), "--out", str(tmp_path / "sim"), "--jobs", "1", "--no-progress"])
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                f"sg-test-{port}",
                "-m",
                "shrinkgrad.distributed",
                str(cfg),
                "--out",
                str(tmp_path / "dist"),
                "--timeout",
                "60",
            ],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    logs = []
    try:
        for a in agents:
            out, _ = a.communicate(timeout=150)
            logs.append(out)
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(logs)
    # exactly one process (global rank 0) reported the table, on one of the two agents
    assert sum("4 processes → " in log for log in logs) == 1, "\n".join(logs)
    _compare(tmp_path / "dist", tmp_path / "sim", world_size=4)
