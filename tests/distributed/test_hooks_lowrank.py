"""PowerSGD's factor all-reduce in the DDP hook (``power_sgd[rank, shared=true]``): the hook on 2
gloo ranks follows the simulator's shared-basis PowerSGD with 2 clients (float64, 1e-10), runs
with several buckets (the Q all-reduce started from the P callback, never waiting there) in
float32 and bfloat16, and sends exactly the factors, r(m + n) values per compressed tensor."""

from __future__ import annotations

import math

import pytest
import torch
from ddp_helpers import SHAPES, Job, run
from test_hooks_methods import STEPS, _on_ranks, _problem, _simulated

from shrinkgrad.distributed import CompressionState, spawn
from shrinkgrad.methods import make_method
from shrinkgrad.network import hook_collectives

pytestmark = [pytest.mark.distributed]

SHARED = "power_sgd[rank=2,shared=true]"


@pytest.mark.timeout(240)
def test_hook_follows_the_simulators_shared_basis() -> None:
    cases = [(name, make_method(name), SHARED) for name in ("ef21", "ef")]
    problem = _problem()
    gamma = 0.5 / problem.L
    got = spawn(_on_ranks, 2, (cases, gamma), timeout=220.0)
    for label, method, compressor in cases:
        want = _simulated(method, compressor, gamma)
        xs, rounds = got[0][label]
        assert got[1][label][1] == rounds and rounds[-1] >= STEPS - 1
        for t in range(STEPS):
            assert torch.equal(xs[t], got[1][label][0][t]), f"{label}: ranks differ at step {t}"
            err = float((xs[t] - want[rounds[t]]).abs().max())
            assert err <= 1e-10, f"{label}: iteration {t} (round {rounds[t]}) is off by {err:.3g}"
        assert float((xs[-1] - problem.x0()).norm()) > 1e-6, f"{label}: the trajectory is still"


def _factor_values(min_numel: int, r: int = 2) -> int:
    """Values one rank sends per compressed step of ddp_helpers' model: r(m + n) per tensor of
    at least min_numel entries (its matrix view: (shape[0], rest), the flat rule for vectors),
    the raw values of the others."""
    total = 0
    for shape in SHAPES:
        numel = math.prod(shape)
        if numel < min_numel:
            total += numel
            continue
        if len(shape) >= 2:
            m, n = shape[0], numel // shape[0]
        else:
            n = math.isqrt(numel) + (math.isqrt(numel) ** 2 < numel)
            m = -(-numel // n)
        total += r * (m + n)
    return total


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["ef21", "ef", "ef21_sgdm[beta=0.5]"])
def test_several_buckets_on_gloo_run_and_count_the_factors(dtype: torch.dtype, method: str) -> None:
    job = Job(
        compressor=SHARED,
        method=method,
        steps=5,
        dtype=dtype,
        bucket_cap_mb=0.004,  # one bucket per tensor or two
        record_bytes=True,
        momentum_free=method.startswith("ef21_sgdm"),
    )
    res = spawn(run, 2, (job,), timeout=200.0)
    for t in range(job.steps):
        assert torch.equal(res[0]["params"][t], res[1]["params"][t]), t  # identical replicas
        assert bool(torch.isfinite(res[0]["params"][t]).all())
    assert not torch.equal(res[0]["params"][-1], res[0]["params"][0])
    esize = torch.finfo(dtype).bits // 8
    # the warm-up step goes in the method's dtype: float32 (the float32 memory's exact sum)
    dense = sum(math.prod(s) for s in SHAPES) * 4
    want = _factor_values(job.min_numel) * esize
    for r in range(2):
        assert res[r]["sent"][0] == res[r]["state_bytes"][0] == dense  # the warm-up step
        assert res[r]["sent"][1:] == res[r]["state_bytes"][1:] == [want] * (job.steps - 1)
    model = hook_collectives(
        SHARED,
        [[math.prod(s) for s in SHAPES]],
        shapes=[SHAPES],
        min_numel=job.min_numel,
        dtype=dtype,
    )
    assert sum(c.nbytes for c in model) == want
    assert [c.kind for c in model] == ["allreduce", "allreduce"]


def _refusal(rank: int, world: int, spec: str, method: str) -> str:
    try:
        CompressionState(spec, method=method, min_numel=45, weights=[1.0, 2.0][:world])
    except ValueError as e:
        return str(e)
    return "no error"


def test_per_client_power_sgd_and_weights_are_refused_in_one_line() -> None:
    (msg,) = spawn(_refusal, 1, ("power_sgd[rank=2]", "ef21_w"))
    assert msg.startswith("power_sgd[rank=2] is per-client PowerSGD") and "\n" not in msg
    assert "power_sgd[rank=2,shared=true]" in msg
    (msg,) = spawn(_refusal, 1, (SHARED, "ef21_w"))
    assert "weighted methods (ef21_w)" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="per-client PowerSGD"):
        hook_collectives("power_sgd[rank=2]", [1152, 48], min_numel=45)
