"""The bytes each runtime sends, computed by hand from the compressors' bit formulas."""

from __future__ import annotations

import math

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
