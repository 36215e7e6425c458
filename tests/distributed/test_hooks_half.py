"""bfloat16 and float16 models in the DDP hook (issue 14; forked gloo ranks on 127.0.0.1).

gloo all-reduces and all-gathers 16-bit tensors on CPU (torch 2.13), so the hook's messages
travel in the gradients' own dtype. The method computes in float32 by default
(``state_dtype="float32"``): its memory holds what was sent (the 16-bit values) upcast.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from ddp_helpers import SHAPES, Job, _batch, expected_bytes, make_model, run
from torch.nn.parallel import DistributedDataParallel as DDP

from shrinkgrad.distributed import CompressionState, compression_hook, spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

HALVES = [torch.bfloat16, torch.float16]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("dtype", HALVES, ids=_name)
@pytest.mark.parametrize(
    "job",
    [
        Job(compressor="top_k", ratio=0.1, method="ef21"),
        Job(compressor="rand_k_scaled", ratio=0.2, method="ef", seed=3),
        Job(compressor="natural"),
        Job(compressor="top_k", ratio=0.1, method="ef21", state_dtype="gradient"),
    ],
    ids=lambda j: f"{j.compressor}-{j.method}-{j.state_dtype}",
)
def test_a_16_bit_model_trains_with_16_bit_values_on_the_wire(job: Job, dtype: torch.dtype) -> None:
    """Every rank ends with the same 16-bit parameters, and a compressed step's bytes — counted
    by the state and, independently, at the collectives themselves — equal the compressors'
    bit formulas with 16-bit values (the uncompressed biases: 2 bytes a value); the first step
    (the method's initialisation or a warm-up round) is dense: in float32 with float32 memory
    (4 bytes per parameter: the exact sum of the float32 messages the ranks keep), in the
    16-bit dtype with ``state_dtype="gradient"`` (2 bytes per parameter)."""
    job = dataclasses.replace(job, dtype=dtype, steps=4, record_bytes=True)
    out = spawn(run, 2, (job,))
    numel = sum(math.prod(s) for s in SHAPES)
    want = expected_bytes(job, 2, dtype)
    assert want < expected_bytes(job, 2, torch.float32)
    first = (4 if job.state_dtype == "float32" else 2) * numel
    for r in range(2):
        assert out[r]["state_bytes"] == [first] + [want] * (job.steps - 1)
        assert out[r]["sent"] == out[r]["state_bytes"]
        for t in range(job.steps):
            assert out[r]["params"][t].dtype == dtype
            assert torch.equal(out[r]["params"][t], out[0]["params"][t])
        assert bool(torch.isfinite(out[r]["params"][-1]).all())
    assert not torch.equal(out[0]["params"][0], out[0]["params"][-1])


def _ef21_memories(rank: int, world: int, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """top_k 10% + EF21 (init="full", float32 memory): every tensor's g and this rank's g_i
    after each of 4 steps, by the tensor's size."""
    model = make_model(dtype)
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = CompressionState("top_k", ratio=0.1, method="ef21", min_numel=45)
    ddp.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.2)
    out = []
    for step in range(4):
        X, y = _batch(rank, step, dtype)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(X), y).backward()
        opt.step()
        mem = state.state_dict()["memory"]
        out.append(
            {
                f"{kind}{v['state']['server.g'].numel()}": v["state"][f"{kind}.g"].clone()
                for v in mem.values()
                for kind in ("server", "clients")
            }
        )
    return out


@pytest.mark.parametrize("dtype", HALVES, ids=_name)
def test_ef21s_float32_memory_keeps_g_the_mean_of_the_g_i_in_a_16_bit_model(
    dtype: torch.dtype,
) -> None:
    """EF21's invariant g = (1/n) Σ g_i, bit for bit on 2 ranks (halving is exact), at every
    step: the dense initialisation sums the ranks' float32 messages (g_i = ∇f_i exactly). It
    used to all-reduce them in the 16-bit dtype — g was the 16-bit sum of the rounded x_i/n, up
    to half a 16-bit unit away from the mean of the g_i, for the rest of the run."""
    out = spawn(_ef21_memories, 2, (dtype,))
    for t in range(4):
        for name in out[0][t]:
            if not name.startswith("server"):
                continue
            d = name.removeprefix("server")
            g = out[0][t][name].reshape(-1)
            assert g.dtype == torch.float32 and torch.equal(g, out[1][t][name].reshape(-1))
            mean = (out[0][t]["clients" + d] + out[1][t]["clients" + d]).reshape(-1) / 2
            assert torch.equal(g, mean), (t, name, float((g - mean).abs().max()))


# --------------------------------------------------------------------------------------------
# the summed paths: EF21's 16-bit messages are summed in float32 (summation="auto")
# --------------------------------------------------------------------------------------------
SUMMED = {
    "identity": dict(compressor="identity"),
    "values": dict(compressor="rand_k_scaled[shared_seed=true]", ratio=0.2),
    "factors": dict(compressor="power_sgd[rank=1,shared=true]"),
}


def _summed_memories(
    rank: int, world: int, dtype: torch.dtype, path: str, summation: str
) -> dict[str, Any]:
    """EF21 (float32 memory) with a compressor of a summed path (``path``: SUMMED) for 5 steps:
    every tensor's g and this rank's g_i after the last one, by size; the bytes of every step,
    and the collective the state reports."""
    model = make_model(dtype)
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = CompressionState(
        method="ef21",
        min_numel=45,
        summation=summation,
        **SUMMED[path],  # type: ignore[arg-type]
    )
    ddp.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.2)
    sent = []
    for step in range(5):
        X, y = _batch(rank, step, dtype)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(X), y).backward()
        opt.step()
        sent.append(state.last_step_bytes)
    mem = state.state_dict()["memory"]
    g = {
        f"{kind}{v['state']['server.g'].numel()}": v["state"][f"{kind}.g"].clone()
        for v in mem.values()
        for kind in ("server", "clients")
    }
    return {"g": g, "sent": sent, "gathered": state.gathers_sums(dtype)}


def _drift(out: list[dict[str, Any]]) -> float:
    """max over tensors of |g − (1/n) Σ_i g_i| / max |g| (ranks' g checked identical)."""
    worst = 0.0
    n = len(out)
    for name, g in out[0]["g"].items():
        if not name.startswith("server"):
            continue
        d = name.removeprefix("server")
        g = g.reshape(-1)
        assert g.dtype == torch.float32
        for r in range(1, n):
            assert torch.equal(g, out[r]["g"][name].reshape(-1))
        mean = sum(out[r]["g"]["clients" + d].reshape(-1) for r in range(n)) / n
        worst = max(worst, float((g - mean).abs().max()) / float(g.abs().max()))
    return worst


@pytest.mark.parametrize("dtype", HALVES, ids=_name)
@pytest.mark.parametrize("path", list(SUMMED))
def test_ef21s_16_bit_sums_keep_g_the_mean_of_the_g_i(path: str, dtype: torch.dtype) -> None:
    """EF21 with a compressor whose messages are summed (the identity, a shared-seed rand-k's
    values, PowerSGD's factors) in a 16-bit model: by default (``summation="auto"``) the ranks'
    16-bit messages are all-gathered and summed in float32, so g stays the mean of the g_i to
    float32 round-off; summed in 16 bits (``summation="reduce"``, the all-reduce) g drifts by
    a 16-bit rounding per round. Both send the same bytes from every rank (the messages'
    16-bit values)."""
    exact = spawn(_summed_memories, 2, (dtype, path, "auto"))
    rounded = spawn(_summed_memories, 2, (dtype, path, "reduce"))
    assert exact[0]["gathered"] and not rounded[0]["gathered"]
    assert exact[0]["sent"] == rounded[0]["sent"]
    assert _drift(exact) <= 1e-6, _drift(exact)
    assert _drift(rounded) >= 1e-5, _drift(rounded)  # the known limit without the float32 sum


# --------------------------------------------------------------------------------------------
# the float32 memory equals an independent float32 computation of EF on the upcast gradient
# --------------------------------------------------------------------------------------------
def _ef_states(rank: int, world: int, dtype: torch.dtype) -> dict[str, Any]:
    """EF + Top-k 10%: per step, this rank's own 16-bit gradient of every tensor (from a replica
    outside DDP, by numel: SHAPES' sizes are distinct) and the hook's e_i afterwards."""
    model = make_model(dtype)
    replica = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = CompressionState("top_k", ratio=0.1, method="ef", min_numel=45)
    ddp.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.2)
    grads, memories = [], []
    for step in range(4):
        X, y = _batch(rank, step, dtype)
        replica.load_state_dict(model.state_dict())
        replica.zero_grad()
        torch.nn.functional.cross_entropy(replica(X), y).backward()
        grads.append({p.numel(): p.grad.reshape(-1).clone() for p in replica.parameters()})
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(X), y).backward()
        opt.step()
        mem = state.state_dict()["memory"]
        memories.append(
            {
                int(v["state"]["clients.e"].numel()): v["state"]["clients.e"].clone()
                for v in mem.values()
            }
        )
    return {"grads": grads, "memories": memories}


@pytest.mark.parametrize("dtype", HALVES, ids=_name)
def test_the_float32_memory_is_ef_on_the_upcast_gradient_with_16_bit_messages(
    dtype: torch.dtype,
) -> None:
    """state_dtype="float32" (the default): e_i is float32 and follows EF in float32 from the
    upcast 16-bit gradient, p = e + g, e ← p − v, where v is what went on the wire: Top-k of p
    rounded to the 16-bit dtype (selected on the rounded values), its entries upcast again."""
    out = spawn(_ef_states, 2, (dtype,))
    for r in range(2):
        grads, memories = out[r]["grads"], out[r]["memories"]
        sizes = sorted(memories[-1])
        assert sizes == sorted(math.prod(s) for s in SHAPES)
        e = {d: torch.zeros(d, dtype=torch.float32) for d in sizes}
        checked = 0
        for t in range(len(grads)):
            for d in sizes:
                got = memories[t][d].reshape(-1)
                assert got.dtype == torch.float32
                if t == 0:  # the first step is dense (DDP's bucket rebuild): e stays 0
                    assert not bool(got.any())
                    continue
                p = e[d] + grads[t][d].to(torch.float32)
                q = p.to(dtype).to(torch.float32)  # the values the wire can carry
                if d < 45:  # sent uncompressed: e keeps the 16-bit rounding's residual
                    assert torch.equal(got, p - q)
                else:
                    k = math.ceil(0.1 * d)
                    kth = q.abs().topk(k).values[-1]
                    kept = (p - got).nonzero().reshape(-1)  # where the hook sent a value
                    # Top-k of the rounded values: every larger one kept, ties at the k-th
                    assert kept.numel() == k
                    assert bool((q.abs()[kept] >= kth).all())
                    assert int((q.abs()[kept] > kth).sum()) == int((q.abs() > kth).sum())
                    v = torch.zeros_like(p)
                    v[kept] = q[kept]
                    assert torch.equal(got, p - v)
                e[d] = got
                checked += 1
        assert checked == len(sizes) * (len(grads) - 1)
        assert any(float(m.abs().max()) > 0 for m in e.values())


# --------------------------------------------------------------------------------------------
# checkpoints of 16-bit runs
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALVES, ids=_name)
@pytest.mark.parametrize("state_dtype", ["float32", "gradient"])
def test_a_16_bit_checkpoint_continues_the_same_trajectory(
    dtype: torch.dtype, state_dtype: str, tmp_path: Path
) -> None:
    """Saved after 3 steps and restored in fresh processes (new DDP, new buckets), a 16-bit run
    continues bit for bit as the uninterrupted one, with its memory in the same dtype."""
    job = Job(
        compressor="top_k", ratio=0.1, method="ef21", dtype=dtype, steps=6, state_dtype=state_dtype
    )
    straight = spawn(run, 2, (job,))
    prefix = str(tmp_path / "ckpt")
    first = spawn(run, 2, (dataclasses.replace(job, steps=3, save=prefix),))
    second = spawn(run, 2, (dataclasses.replace(job, start=3, steps=3, load=prefix),))
    want = torch.float32 if state_dtype == "float32" else dtype
    for r in range(2):
        got = first[r]["params"] + second[r]["params"]
        for t in range(6):
            assert torch.equal(got[t], straight[r]["params"][t]), f"rank {r}, step {t}"
        assert second[r]["bytes_sent"] == straight[r]["bytes_sent"]
        saved = torch.load(f"{prefix}.rank{r}", weights_only=False)["hook"]["memory"]
        dtypes = {
            v.dtype
            for m in saved.values()
            for k, v in m["state"].items()
            if isinstance(v, torch.Tensor)
            and not k.endswith("compressor_state")
            and v.is_floating_point()
        }
        assert dtypes == {want}


def _load_into(rank: int, world: int, path: str, dtype: torch.dtype) -> str:
    model = DDP(make_model(dtype), bucket_cap_mb=0.01)
    state = CompressionState(
        "top_k", ratio=0.1, method="ef21", min_numel=45, state_dtype="gradient"
    )
    model.register_comm_hook(state, compression_hook)
    state.load_state_dict(torch.load(f"{path}.rank{rank}", weights_only=False)["hook"])
    X, y = _batch(rank, 3, dtype)
    try:
        torch.nn.functional.cross_entropy(model(X), y).backward()
    except (ValueError, RuntimeError) as e:
        return str(e)
    return "no error"


def test_a_checkpoint_loaded_into_a_model_of_another_dtype_is_a_clear_error(
    tmp_path: Path,
) -> None:
    """state_dtype="gradient" keeps bfloat16 memory: a float32 model cannot continue it (the
    copy would cast silently); the error names both dtypes."""
    prefix = str(tmp_path / "ckpt")
    job = Job(
        compressor="top_k",
        ratio=0.1,
        method="ef21",
        dtype=torch.bfloat16,
        steps=2,
        state_dtype="gradient",
        save=prefix,
    )
    spawn(run, 2, (job,))
    for message in spawn(_load_into, 2, (prefix, torch.float32)):
        assert "'server.g' is bfloat16 in the checkpoint but float32 in this model" in message
        assert "\n" not in message


def _bad_state_dtype(rank: int, world: int) -> str:
    try:
        CompressionState("top_k", ratio=0.1, method="ef21", state_dtype="float16")  # type: ignore[arg-type]
    except ValueError as e:
        return str(e)
    return "no error"


def test_an_unknown_state_dtype_is_a_one_line_error() -> None:
    (message,) = spawn(_bad_state_dtype, 1, ())
    assert message == (
        "state_dtype must be one of float32, gradient (where the method states of 16-bit "
        "gradients are kept), got 'float16'"
    )


def _bad_summation(rank: int, world: int) -> list[Any]:
    try:
        CompressionState("identity", method="ef21", summation="float32")  # type: ignore[arg-type]
    except ValueError as e:
        message = str(e)
    else:
        message = "no error"
    # "auto": the gathered sum only for 16-bit values, float32 memory and an integrating method
    cases = [
        ("ef21", "float32", torch.bfloat16),
        ("ef21", "float32", torch.float16),
        ("ef21_sgdm", "float32", torch.bfloat16),
        ("diana", "float32", torch.bfloat16),
        ("ef21", "float32", torch.float32),
        ("ef21", "gradient", torch.bfloat16),
        ("dcgd", "float32", torch.bfloat16),
        ("ef", "float32", torch.bfloat16),
    ]
    compressor = {"diana": "rand_k[k=5,shared_seed=true]", "dcgd": "rand_k[k=5,shared_seed=true]"}
    auto = [
        CompressionState(
            compressor.get(m, "top_k[k=5]"),
            method=m,
            state_dtype=s,  # type: ignore[arg-type]
        ).gathers_sums(dt)
        for m, s, dt in cases
    ]
    forced = [
        CompressionState("top_k", ratio=0.1, method="ef", summation=how).gathers_sums(dt)  # type: ignore[arg-type]
        for how in ("gather", "reduce")
        for dt in (torch.float32, torch.bfloat16)
    ]
    return [message, auto, forced]


def test_summation_is_checked_and_auto_gathers_only_where_a_16_bit_sum_would_drift() -> None:
    (out,) = spawn(_bad_summation, 1, ())
    message, auto, forced = out
    assert message == (
        "summation must be one of auto, gather, reduce (how the ranks' summable messages are "
        "added), got 'float32'"
    )
    assert auto == [True, True, True, True, False, False, False, False]
    assert forced == [True, True, False, False]
