"""What practitioners hit after the first run: gradient accumulation, torch.compile, a state
registered twice or on a second model, DDP's bucket rebuild (forked gloo ranks on 127.0.0.1)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from ddp_helpers import Job, expected_bytes, make_model, run
from torch.nn.parallel import DistributedDataParallel as DDP

from shrinkgrad.distributed import CompressionState, compression_hook, spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]


def test_gradient_accumulation_compresses_only_at_the_synchronising_step() -> None:
    """Two micro-steps per step, the first under ``DDP.no_sync()``: DDP does not call the hook
    there (the memory, the iteration and the bytes stay as they were), and the synchronising
    step compresses the accumulated gradient — the same trajectory as one step on the whole
    batch (float64: the two sums of the gradient differ by round-off only)."""
    job = Job(compressor="top_k", ratio=0.1, method="ef21", dtype=torch.float64, steps=4)
    whole = spawn(run, 2, (job,))
    split = spawn(run, 2, (dataclasses.replace(job, accumulate=2),))
    for r in range(2):
        assert split[r]["silent_changes"] == [False] * job.steps
        assert split[r]["iterations"] == whole[r]["iterations"] == job.steps
        assert split[r]["state_bytes"] == whole[r]["state_bytes"]
        for t in range(job.steps):
            torch.testing.assert_close(
                split[r]["params"][t], whole[r]["params"][t], rtol=0, atol=1e-12
            )
    assert split[0]["state_bytes"][1:] == [expected_bytes(job, 2, torch.float64)] * (job.steps - 1)
    assert not torch.equal(split[0]["params"][0], split[0]["params"][-1])


def test_a_compiled_model_trains_like_the_eager_one() -> None:
    """``torch.compile`` of the DDP model (dynamo splits the graph at DDP's buckets; the
    backward runs through DDP's reducer and so through the hook). The suite compiles with
    ``aot_eager`` (dynamo + AOT autograd, no C++ code generation); docs/distributed.md reports
    the inductor backend on this machine."""
    # dynamo's DDP graph splitting asserts that DDP's first bucket (1 MB) is not larger than
    # the others: bucket caps below 1 MB fail in torch itself, so this model is one bucket
    job = Job(compressor="top_k", ratio=0.1, method="ef21", steps=3, bucket_cap_mb=1.0)
    eager = spawn(run, 2, (job,), timeout=140.0)
    compiled = spawn(run, 2, (dataclasses.replace(job, compile="aot_eager"),), timeout=140.0)
    for r in range(2):
        assert compiled[r]["iterations"] == job.steps
        assert compiled[r]["state_bytes"] == eager[r]["state_bytes"]
        for t in range(job.steps):
            assert torch.equal(compiled[r]["params"][t], compiled[0]["params"][t])
            torch.testing.assert_close(
                compiled[r]["params"][t], eager[r]["params"][t], rtol=1e-5, atol=1e-6
            )


def _registrations(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    model = DDP(make_model(), bucket_cap_mb=0.01)
    state = CompressionState("top_k", ratio=0.1, method="ef21", min_numel=45)
    model.register_comm_hook(state, compression_hook)
    try:  # DDP's own refusal, before the hook is involved
        model.register_comm_hook(state, compression_hook)
        out["twice"] = "no error"
    except RuntimeError as e:
        out["twice"] = str(e)
    X, y = torch.randn(8, 24), torch.randint(0, 4, (8,))
    plans = []
    for _ in range(3):  # DDP rebuilds its buckets after the first iteration
        torch.nn.functional.cross_entropy(model(X), y).backward()
        plans.append(sorted(tuple(p.signature) for p in state.planner.plans))
    out["layouts"] = len({tuple(p) for p in plans})
    out["iterations"] = state.iteration
    other = DDP(make_model(), bucket_cap_mb=0.01)
    other.register_comm_hook(state, compression_hook)  # the same state on a second model
    try:
        torch.nn.functional.cross_entropy(other(X), y).backward()
        out["second"] = "no error"
    except RuntimeError as e:
        out["second"] = str(e)
    return out


def test_a_state_registered_twice_or_on_a_second_model_is_a_clear_error() -> None:
    (out,) = spawn(_registrations, 1)
    assert out["twice"] == (
        "register_comm_hook or register_builtin_comm_hook can only be called once."
    )
    assert out["iterations"] == 3
    assert out["layouts"] >= 2  # the rebuilt buckets got new plans
    assert out["second"].startswith("the shrinkgrad hook got a gradient of a parameter (")
    assert (
        "it did not see in its first iteration: one CompressionState serves one DDP model"
        in (out["second"])
    )
    assert "give every model its own CompressionState" in out["second"]


def test_the_bucket_layout_does_not_change_the_trajectory() -> None:
    """Small buckets (rebuilt by DDP after iteration 0, see above) and one bucket for the whole
    model give bit-identical parameters: plans follow the buckets, but the unit of compression,
    the memory and the draws are per tensor."""
    job = Job(compressor="top_k", ratio=0.1, method="ef21", steps=4, bucket_cap_mb=0.004)
    small = spawn(run, 2, (job,))
    one = spawn(run, 2, (dataclasses.replace(job, bucket_cap_mb=1000.0),))
    for r in range(2):
        for t in range(job.steps):
            assert torch.equal(small[r]["params"][t], one[r]["params"][t]), (r, t)
        assert small[r]["state_bytes"] == one[r]["state_bytes"]


def _power_sgd_state(rank: int, world: int, method: str | None) -> str:
    try:
        CompressionState("power_sgd[rank=2]", method=method, min_numel=45)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("method", ["ef21", "ef", None])
def test_per_client_power_sgd_is_refused_in_one_line_naming_the_alternatives(
    method: str | None,
) -> None:
    """Per-client PowerSGD (each rank its own basis) cannot all-reduce its factors: refused
    when the state is built (not at the first backward), naming the shared basis and rank_k;
    the network model refuses it with the same words (it charges only what the hook sends).
    The shared basis runs: tests/distributed/test_hooks_lowrank.py."""
    from shrinkgrad.network import hook_collectives

    (message,) = spawn(_power_sgd_state, 1, (method,))
    assert message.startswith("power_sgd[rank=2] is per-client PowerSGD")
    assert "power_sgd[rank=2,shared=true]" in message and "rank_k[r=2]" in message
    assert "\n" not in message
    with pytest.raises(ValueError) as info:
        hook_collectives("power_sgd[rank=2]", [1152, 48], min_numel=45)
    assert str(info.value) == message
