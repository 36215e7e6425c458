"""The README's Python examples run as printed, and the values their comments state hold.

The ```python blocks are read from README.md at test time, so the test follows the README: every
block runs in one fresh interpreter (each in its own namespace, as a reader would paste it), the
DDP block on a one-rank gloo group with a small DDP model as its ``model``. The values the
comments state are then recomputed here from their formulas, not from the library's own helpers.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"

# one worker runs the module, so the README runs once (its module-scoped fixture)
pytestmark = pytest.mark.xdist_group("readme_snippets")

# Runs every block; prints one JSON line with what the assertions below need.
DRIVER = r"""
import json, sys
import torch
import torch.distributed as dist

torch.set_num_threads(1)
blocks = json.loads(sys.stdin.read())
out = {"blocks": len(blocks)}
for i, code in enumerate(blocks):
    ns = {"__name__": "__readme__"}
    ddp = "register_comm_hook" in code
    if ddp:  # the README's "any training loop": a one-rank DDP model
        store = dist.TCPStore("127.0.0.1", 0, 1, True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        ns["model"] = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2048, 4))
    exec(compile(code, f"README.md python block {i + 1}", "exec"), ns)
    if ddp:
        model, state = ns["model"], ns["state"]
        for _ in range(2):  # the first step is the dense warm-up, the second compresses
            model(torch.randn(8, 2048)).square().mean().backward()
        sd = state.state_dict()
        keys = ("iteration", "bytes_sent", "dense_bytes", "last_step_bytes")
        out["ddp"] = {k: sd[k] for k in keys}
        dist.destroy_process_group()
    if "res" in ns and "C" in ns:  # the five-minute tour
        C, x, y, p, res = ns["C"], ns["x"], ns["y"], ns["p"], ns["res"]
        try:
            C.compress(x)
            out["seed_required"] = False
        except ValueError as e:
            out["seed_required"] = "seed" in str(e)
        t = res.table
        out["tour"] = {
            "kind": C.kind,
            "omega": C.omega(1000),
            "alpha_C": C.alpha(1000),
            "bits": C.bits(1000),
            "paper_bits": C.paper_bits(1000),
            "y_shape": list(y.shape),
            "rows_are_clients": all(
                torch.equal(y[i], C.compress(x[i : i + 1], seed=1, round=0, client=i)[0])
                for i in range(x.shape[0])
            ),
            "n": p.n,
            "d": p.d,
            "L": p.L,
            "L_AM": p.L_AM,
            "L_QM": p.L_QM,
            "L_var": p.L_var,
            "L_i": [float(v) for v in p.L_i],
            "alpha": ns["alpha"],
            "columns": list(t.columns),
            "rounds": [int(r) for r in t["round"]],
            "method": str(t["method"].iloc[0]),
            "stepsize": float(t["stepsize"].iloc[0]),
            "stepsize_rule": str(t["stepsize_rule"].iloc[0]),
            "grad_norm_sq": [float(t["grad_norm_sq"].iloc[0]), float(t["grad_norm_sq"].iloc[-1])],
        }
print(json.dumps(out))
"""


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


@pytest.fixture(scope="module")
def readme_run() -> dict:
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER],
        input=json.dumps(blocks),
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, f"a README python block failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_readme_has_the_five_minute_tour_and_the_ddp_hook() -> None:
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert any("sg.simulate(" in b for b in blocks)
    assert any("register_comm_hook" in b for b in blocks)


def test_every_readme_python_block_runs(readme_run: dict) -> None:
    assert readme_run["blocks"] >= 2
    assert "tour" in readme_run and "ddp" in readme_run


def test_the_compressor_comments_hold(readme_run: dict) -> None:
    t = readme_run["tour"]
    d, s = 1000, 4
    omega = min(d / s**2, math.sqrt(d) / s)  # "ω = min(d/s², √d/s)"
    assert t["kind"] == "unbiased"
    assert t["omega"] == pytest.approx(omega, rel=1e-12)
    assert t["alpha_C"] == pytest.approx(1 / (1 + omega), rel=1e-12)  # "α of C/(1+ω)"
    # QSGD's message: one float32 norm, then per coordinate a sign and a level in 0..s
    bits = 32 + d * (1 + math.ceil(math.log2(s + 1)))
    assert t["bits"] == bits == t["paper_bits"] == 4032  # its one float at 32 bits: the same
    assert t["y_shape"] == [8, 1000]  # "8 clients on the leading axis"
    assert t["rows_are_clients"]  # "row i is client i, with its own draw"
    assert readme_run["seed_required"]  # "seed= is required for a random C"


def test_the_problem_and_step_size_comments_hold(readme_run: dict) -> None:
    t = readme_run["tour"]
    L_i = t["L_i"]
    n = len(L_i)
    am = sum(L_i) / n
    qm = math.sqrt(sum(v * v for v in L_i) / n)
    assert (t["n"], t["d"]) == (100, 300)  # w1a: 300 features, 100 clients
    assert t["L_AM"] == pytest.approx(am, rel=1e-12)
    assert t["L_QM"] == pytest.approx(qm, rel=1e-12)
    assert t["L_var"] == pytest.approx(qm**2 - am**2, rel=1e-9)
    assert t["L"] <= t["L_AM"] <= t["L_QM"]  # "L ≤ L_AM ≤ L_QM"; strict on this split
    assert t["L_AM"] < t["L_QM"]
    alpha = 1 / t["d"]  # Top-1: α = k/d
    assert t["alpha"] == pytest.approx(alpha, rel=1e-15)
    # "theory" for ef21_w is [EFR]'s 1/(L + L_AM ξ(α)), ξ(α) = √(1 − α)/(1 − √(1 − α))
    xi = math.sqrt(1 - alpha) / (1 - math.sqrt(1 - alpha))
    assert t["method"] == "ef21_w"
    assert t["stepsize"] == pytest.approx(1 / (t["L"] + t["L_AM"] * xi), rel=1e-9)
    assert t["stepsize"] > 1 / (t["L"] + t["L_QM"] * xi)  # larger than EF21's γ_QM
    assert t["stepsize_rule"] == "stepsize_ef21_reloaded"  # "records the rule"


def test_the_results_table_is_as_listed(readme_run: dict) -> None:
    t = readme_run["tour"]
    listed = ["round", "grad_norm_sq", "loss", "bits_up", "bits_up_paper", "bits_down", "time_s"]
    assert t["columns"][: len(listed) + 1] == [*listed, "method"]
    assert t["rounds"] == list(range(0, 2001, 100))  # rounds=2000, log_every=100
    first, last = t["grad_norm_sq"]
    assert last < first / 10  # it converges


def test_the_ddp_hook_sends_the_compressors_bits(readme_run: dict) -> None:
    ddp = readme_run["ddp"]
    # Linear(2048, 4): the 8192-entry weight is compressed by top_k at ratio 0.01 (k = 82 indices
    # of ⌈log₂ 8192⌉ = 13 bits and 82 float32 values); the 4-entry bias is below min_numel: dense
    k = math.ceil(0.01 * 8192)
    weight_bytes = math.ceil(k * (32 + 13) / 8)
    assert ddp["iteration"] == 2
    assert ddp["last_step_bytes"] == weight_bytes + 4 * 4
    assert ddp["bytes_sent"] == (8192 + 4) * 4 + ddp["last_step_bytes"]  # dense warm-up step
