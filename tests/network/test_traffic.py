"""The bytes each runtime sends, computed by hand from the compressors' bit formulas."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from shrinkgrad.compressors import make_compressor
from shrinkgrad.network import Collective, hook_collectives, ps_messages, summable

SIZES = [2048, 64, 640, 10]  # two weights, a bias that is compressed or not, a small bias


def test_top_k_with_ratio_all_gathers_packed_payloads_with_raw_small_tensors() -> None:
    # k = ⌈0.1 d⌉ of ⌈log2 d⌉ index bits + 32 value bits; the 10-entry tensor travels raw
    got = hook_collectives("top_k", SIZES, ratio=0.1, min_numel=45)
    payload = [math.ceil(205 * (11 + 32) / 8), math.ceil(7 * (6 + 32) / 8), 64 * (10 + 32) // 8]
    assert payload == [1102, 34, 336]
    assert got == [Collective("allgather", 40 + sum(payload), "bucket 0: packed payloads")]


def test_qsgd_counts_its_norm_and_levels_and_leaves_tensors_under_min_numel_raw() -> None:
    got = hook_collectives("qsgd[s=4]", SIZES, min_numel=100)
    # 32 bits of norm + d·(1 sign + 3 level bits); 64 and 10 entries raw float32
    assert [c.nbytes for c in got] == [(32 + 4 * 2048) // 8 + (32 + 4 * 640) // 8 + 4 * 74]
    assert got[0].kind == "allgather"


def test_summable_and_shared_seed_compressors_all_reduce() -> None:
    (dense,) = hook_collectives("identity", SIZES, min_numel=0)
    assert dense == Collective("allreduce", 4 * sum(SIZES), "bucket 0: summable dense results")
    (values,) = hook_collectives("rand_k[shared_seed=true]", SIZES, ratio=0.1, min_numel=45)
    assert values.kind == "allreduce" and values.nbytes == 4 * (205 + 7 + 64) + 4 * 10
    assert summable(make_compressor("rand_k[k=3,shared_seed=true]")) is True
    assert summable(make_compressor("identity")) is True
    assert summable(make_compressor("top_k[k=3]")) is False
    # scaled(rand_k[shared]) is the operator rand_k_scaled[shared]: its k values are summable
    # too (the wrapper keeps the shared seed), and only the unshared form all-gathers
    wrapped = "scaled(rand_k[k=20,shared_seed=true])"
    assert summable(make_compressor(wrapped)) is True
    assert summable(make_compressor("scaled(rand_k[k=20])")) is False
    assert hook_collectives(wrapped, [2048], min_numel=45) == hook_collectives(
        "rand_k_scaled[k=20,shared_seed=true]", [2048], min_numel=45
    )


def test_buckets_warm_up_variable_sizes_scaler_and_dtype() -> None:
    buckets = [[2048, 64], [640, 10]]
    warm = hook_collectives("top_k", buckets, ratio=0.1, warmup=True)
    assert [(c.kind, c.nbytes) for c in warm] == [("allreduce", 4 * 2112), ("allreduce", 4 * 650)]
    # 16-bit gradients: the warm-up all-reduces the float32 memory's messages (4 bytes), or the
    # 16-bit values with state_dtype="gradient" (as the hook counts: tests/distributed)
    for dt in (torch.bfloat16, torch.float16):
        warm16 = hook_collectives("top_k", buckets, ratio=0.1, warmup=True, dtype=dt)
        assert [c.nbytes for c in warm16] == [4 * 2112, 4 * 650]
        warm16 = hook_collectives(
            "top_k", buckets, ratio=0.1, warmup=True, dtype=dt, state_dtype="gradient"
        )
        assert [c.nbytes for c in warm16] == [2 * 2112, 2 * 650]
    with pytest.raises(ValueError, match="state_dtype must be one of float32, gradient"):
        hook_collectives("top_k", buckets, ratio=0.1, state_dtype="bf16")
    # min_numel 1024: the second bucket has nothing to compress: a plain dense all-reduce
    got = hook_collectives("top_k", buckets, ratio=0.1, scaler=True)
    assert [(c.kind, c.nbytes) for c in got] == [("allgather", 1102 + 256 + 1), ("allreduce", 2600)]
    # bernoulli: the sizes first (one int64), then int32 sizes + expected payloads, padded
    var = hook_collectives("bernoulli[p=0.25]", [4096], min_numel=0)
    expected = math.ceil((32 + 0.25 * 4096 * (32 + 12)) / 8)
    assert [(c.kind, c.nbytes) for c in var] == [("allgather", 8), ("allgather", 4 + expected)]
    half = hook_collectives("identity", [100], min_numel=0, dtype=torch.float64)
    assert half[0].nbytes == 800


def test_parameter_server_messages() -> None:
    m = ps_messages("qsgd[s=4]", 123)
    assert m.down == (32 + 123 * 8,)  # header + the float64 model
    assert m.up == (72, math.ceil((32 + 123 * 4) / 8))  # 9-word reply header + the payload
    assert ps_messages("identity", 10, wire_dtype=torch.float64).up == (72, 80)
    assert ps_messages("top_k[k=1]", 10, dense=True).up == (72, 40)  # d float32 values


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (lambda: hook_collectives("qsgd[s=4]", [100], ratio=0.1), r"ratio=0.1 needs a compressor"),
        (lambda: hook_collectives("top_k[k=5]", [3], min_numel=0), r"cannot compress a tensor"),
        (lambda: hook_collectives("top_k", [], ratio=0.1), r"tensors must be a non-empty list"),
        (lambda: hook_collectives("top_k", [0], ratio=0.1), r"integer >= 1, got 0"),
        (lambda: hook_collectives("top_k", [4], ratio=1.5), r"ratio must be a number in \(0, 1\]"),
        (lambda: hook_collectives("topk", [4]), r"unknown compressor 'topk'"),
    ],
)
def test_mistakes_are_clear(call: object, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        call()  # type: ignore[operator]


SUMMED = [  # (compressor, hook arguments, method): every summed path of the hook
    ("identity", {"min_numel": 0}, None),
    ("identity", {"min_numel": 0}, "ef21"),
    ("rand_k_scaled[shared_seed=true]", {"ratio": 0.1, "min_numel": 45}, "ef21"),
    ("rand_k_scaled[shared_seed=true]", {"ratio": 0.1, "min_numel": 45}, "ef"),
    ("rand_k[shared_seed=true]", {"ratio": 0.1, "min_numel": 45}, "diana"),
    ("rand_k[shared_seed=true]", {"ratio": 0.1, "min_numel": 45}, None),
    ("top_k", {"ratio": 0.1}, "ef21"),  # bucket 0 all-gathers anyway; the raw bucket 1 is summed
]


@pytest.mark.parametrize("spec,kw,method", SUMMED, ids=[f"{s}-{m}" for s, _, m in SUMMED])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("summation", ["auto", "gather", "reduce"])
@pytest.mark.parametrize("state_dtype", ["float32", "gradient"])
def test_summed_rounds_are_all_gathered_exactly_where_the_hook_gathers_them(
    spec: str,
    kw: dict[str, Any],
    method: str | None,
    dtype: torch.dtype,
    summation: str,
    state_dtype: str,
) -> None:
    """The model follows the hook's own rule (what ``CompressionState.gathers_sums`` asks: its
    settings and its planner's method dtype): where the hook gathers, each all-reduce of a
    compressed step is an all-gather of the same per-rank bytes; payloads that are all-gathered
    anyway and warm-up steps are unchanged. By default only 16-bit gradients with a float32
    memory under EF21 or DIANA gather."""
    from shrinkgrad.distributed.hooks.config import Settings
    from shrinkgrad.distributed.hooks.plan import Planner

    buckets = [[2048, 64], [640, 10]]
    args = dict(kw, dtype=dtype, state_dtype=state_dtype)
    settings = Settings.build(
        spec,
        method=method,
        error_feedback=None,
        ratio=kw.get("ratio"),
        weights=None,
        seed=0,
        warmup_steps=1,
        momentum=0.0,
        min_numel=int(kw["min_numel"]) if "min_numel" in kw else 1024,
        world_size=4,
        rank=0,
        state_dtype=state_dtype,
        summation=summation,
    )
    planner = Planner(settings, lambda *a: None, bool(settings.method.sparse_messages))
    gathers = settings.gathers(dtype, planner.work_dtype(dtype))
    assert gathers == (
        summation == "gather"
        or (
            summation == "auto"
            and dtype != torch.float32
            and state_dtype == "float32"
            and method in ("ef21", "diana")
        )
    )
    reduced = hook_collectives(spec, buckets, summation="reduce", **args)
    got = hook_collectives(spec, buckets, method=method, summation=summation, **args)
    assert [c.nbytes for c in got] == [c.nbytes for c in reduced]
    assert any(c.kind == "allreduce" for c in reduced)  # every case has a summed round
    for g, r in zip(got, reduced, strict=True):
        assert g.kind == ("allgather" if gathers or r.kind == "allgather" else "allreduce")
    warm = hook_collectives(spec, buckets, method=method, summation=summation, warmup=True, **args)
    assert all(c.kind == "allreduce" for c in warm)


def test_hook_collectives_checks_summation_and_method() -> None:
    with pytest.raises(ValueError, match="summation must be one of auto, gather, reduce"):
        hook_collectives("identity", [100], summation="sum")
    with pytest.raises(ValueError, match="iag has no per-tensor rule for a DDP communication"):
        hook_collectives("identity", [100], method="iag")


def test_ratio_sets_the_k_inside_scaled() -> None:
    """scaled(strat_k[shared_seed=true]) with ratio=: k = ⌈ratio·d⌉ of each tensor inside
    scaled(), whose shared seed keeps the values-only all-reduce (k values of 4 bytes)."""
    (values,) = hook_collectives(
        "scaled(strat_k[shared_seed=true])", SIZES, ratio=0.1, min_numel=45
    )
    assert values.kind == "allreduce" and values.nbytes == 4 * (205 + 7 + 64) + 4 * 10
    (packed,) = hook_collectives("scaled(strat_k)", [2048], ratio=0.1)
    assert packed.nbytes == math.ceil(205 * (32 + 4) / 8)  # offsets in blocks of ≤ 10 entries
    with pytest.raises(ValueError, match=r"'scaled\(strat_k\[k=3\]\)' fixes k=3"):
        hook_collectives("scaled(strat_k[k=3])", [2048], ratio=0.1)
    with pytest.raises(ValueError, match=r"strat_k, or scaled\(\) of one\), got 'scaled\(natural"):
        hook_collectives("scaled(natural)", [2048], ratio=0.1)
