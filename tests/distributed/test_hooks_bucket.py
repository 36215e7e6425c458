"""``CompressionState(granularity="bucket")``: every DDP bucket compressed as one flat vector
(forked gloo ranks on 127.0.0.1)."""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_helpers import SHAPES, Job, _batch, make_model, run
from torch.nn.parallel import DistributedDataParallel as DDP

from shrinkgrad.compressors import make_compressor
from shrinkgrad.distributed import CompressionState, compression_hook, spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(150)]

RATIO = 0.1
CAP_MB = 0.02  # several buckets of several tensors each, regrouped by DDP's rebuild


def _recorded(rank: int, world: int, method: str, steps: int) -> list[list[Any]]:
    """Train a float64 model at bucket granularity with top-k, recording for every bucket
    call its parameters (by position in the model), its raw gradients and what DDP got."""
    model = DDP(make_model(torch.float64), bucket_cap_mb=CAP_MB)
    position = {id(p): i for i, p in enumerate(model.parameters())}
    state = CompressionState(
        "top_k", ratio=RATIO, method=method, min_numel=45, granularity="bucket"
    )
    calls: list[list[Any]] = []

    def hook(st: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        params = [position[id(p)] for p in bucket.parameters()]
        raw = bucket.buffer().clone()
        fut = compression_hook(st, bucket)

        def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            out = f.value()
            calls[-1].append((params, raw, out.clone()))
            return out

        return fut.then(done)

    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for step in range(steps):
        calls.append([])
        X, y = _batch(rank, step, torch.float64)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
    return calls


def _split(params: list[int], v: torch.Tensor) -> dict[int, torch.Tensor]:
    sizes = [math.prod(SHAPES[i]) for i in params]
    return dict(zip(params, v.split(sizes), strict=True))


def test_a_bucket_unit_is_ef21_on_the_bucket_vector_through_the_bucket_rebuild() -> None:
    """One rank, EF21 (g = h_1): every bucket's direction is g ← g + top-k(∇f − g) over the
    whole bucket (k = ⌈0.1 · d_bucket⌉, one selection across its tensors, biases included),
    with g the directions DDP got for the same parameters the step before — also at step 1,
    the first one in DDP's rebuilt buckets, where each bucket unit's memory is joined from the
    old units' parameters. Computed here with torch.topk on the recorded gradients."""
    steps = 4
    (calls,) = spawn(_recorded, 1, ("ef21", steps))
    layouts = [sorted(tuple(p) for p, _, _ in step) for step in calls]
    assert layouts[1] != layouts[0]  # DDP regrouped the parameters after step 0
    assert all(layouts[t] == layouts[1] for t in range(1, steps))
    assert max(len(p) for p, _, _ in calls[1]) >= 3  # a bucket unit of several tensors
    g: dict[int, torch.Tensor] = {}
    for t, step in enumerate(calls):
        for params, raw, out in step:
            if t == 0:  # EF21's initialisation: g = ∇f, uncompressed
                assert torch.equal(out, raw)
            else:
                prev = torch.cat([g[i] for i in params])
                diff = raw - prev
                k = math.ceil(RATIO * raw.numel())
                idx = diff.abs().topk(k).indices
                want = prev.clone()
                want[idx] = prev[idx] + diff[idx]
                assert torch.equal(out, want), (t, params)
                assert int((out != prev).sum()) <= k
        for params, _, out in step:
            g.update(_split(params, out))


def test_a_bucket_checkpoint_holds_one_entry_per_parameter(tmp_path: Path) -> None:
    """Saved after 3 steps (DDP's rebuilt layout): one entry per parameter, each of its
    parameter's size, as at tensor granularity (the restart itself continues bit for bit:
    ``test_restart_from_a_checkpoint_continues_the_same_trajectory`` in test_hooks.py)."""
    prefix = str(tmp_path / "ckpt")
    job = Job(
        compressor="top_k",
        ratio=RATIO,
        method="ef21",
        steps=3,
        bucket_cap_mb=CAP_MB,
        granularity="bucket",
        save=prefix,
    )
    spawn(run, 2, (job,))
    for r in range(2):
        memory = torch.load(f"{prefix}.rank{r}", weights_only=False)["hook"]["memory"]
        assert sorted(memory) == list(range(len(SHAPES)))
        sizes = {math.prod(s) for s in SHAPES}  # (distinct: a size names its tensor)
        for entry in memory.values():
            assert entry["round"] == 2  # (the initialisation is round 0)
            lengths = {
                v.shape[-1]
                for name, v in entry["state"].items()
                if isinstance(v, torch.Tensor) and v.ndim >= 1 and "compressor" not in name
            }
            assert len(lengths) == 1 and lengths <= sizes


def _keyed(rank: int, world: int, steps: int) -> list[list[Any]]:
    """Shared-seed rand-k (DCGD) at bucket granularity on one rank: for every bucket call,
    its raw gradients, what DDP got, and the canonical id of its first parameter."""
    model = DDP(make_model(torch.float64), bucket_cap_mb=CAP_MB)
    state = CompressionState(
        "rand_k[shared_seed=true]", ratio=RATIO, min_numel=45, seed=7, granularity="bucket"
    )
    calls: list[list[Any]] = []

    def hook(st: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        first = bucket.parameters()[0]
        raw = bucket.buffer().clone()
        fut = compression_hook(st, bucket)
        calls[-1].append((raw, fut.wait().clone(), st.planner.uid(first)))
        return fut

    model.register_comm_hook(state, hook)
    for step in range(steps):
        calls.append([])
        X, y = _batch(rank, step, torch.float64)
        torch.nn.functional.cross_entropy(model(X), y).backward()
    return calls


def test_a_bucket_units_draw_is_keyed_by_its_first_parameter() -> None:
    """A bucket unit draws as the hook documents for a tensor, with its first parameter's
    canonical id: ``Keys.derive(seed, round=t, client=0, stream="ddp_hook").fold(id)`` — a
    function of the layout, not of the order in which its plan was made."""
    from shrinkgrad.rng import Keys

    (calls,) = spawn(_keyed, 1, (3,))
    for t, step in enumerate(calls[1:], start=1):  # (step 0: the uncompressed warm-up)
        for raw, out, first in step:
            d = raw.numel()
            C = make_compressor(f"rand_k[shared_seed=true,k={math.ceil(RATIO * d)}]")
            keys = Keys.derive(7, round=t, client=0, stream="ddp_hook").fold(first)
            assert torch.equal(out, C(raw, keys)), (t, first)


def _bytes(rank: int, world: int, granularity: str) -> tuple[int, list[int], list[list[int]]]:
    """The compressed step's bytes, the bucket sizes of the rebuilt layout and its tensors'
    sizes bucket by bucket."""
    model = DDP(make_model(), bucket_cap_mb=0.008)  # float32: the same bucket count
    state = CompressionState(
        "rand_k[shared_seed=true]", ratio=RATIO, min_numel=45, granularity=granularity
    )
    model.register_comm_hook(state, compression_hook)
    for step in range(3):
        X, y = _batch(rank, step, torch.float32)
        torch.nn.functional.cross_entropy(model(X), y).backward()
    plans = state.planner.plans
    layout = [[n for u in p.units for n in ([m for _, m in u.members] or [u.numel])] for p in plans]
    return state.last_step_bytes, sorted(p.numel for p in plans), layout


def test_a_bucket_sends_the_bits_of_one_vector_of_its_size() -> None:
    """Shared-seed rand-k all-reduces k = ⌈0.1 · d⌉ values per unit: at bucket granularity d
    is each bucket's size (the biases included), per tensor each compressed tensor's. The
    network model (``hook_collectives(..., granularity=...)``) charges the same bytes."""
    from shrinkgrad.network import hook_collectives

    per_bucket = spawn(_bytes, 2, ("bucket",))
    per_tensor = spawn(_bytes, 2, ("tensor",))
    sizes = per_bucket[0][1]
    assert len(sizes) >= 2 and sum(sizes) == sum(math.prod(s) for s in SHAPES)
    want = sum(4 * math.ceil(RATIO * d) for d in sizes)
    want_tensor = sum(
        4 * math.ceil(RATIO * math.prod(s)) if math.prod(s) >= 45 else 4 * math.prod(s)
        for s in SHAPES
    )
    for r in range(2):
        assert per_bucket[r][0] == want
        assert per_tensor[r][0] == want_tensor
    assert want != want_tensor
    for (sent, _, layout), granularity in [(per_bucket[0], "bucket"), (per_tensor[0], "tensor")]:
        model = hook_collectives(
            "rand_k[shared_seed=true]", layout, ratio=RATIO, min_numel=45, granularity=granularity
        )
        assert sum(c.nbytes for c in model) == sent, granularity


def _refusal(rank: int, world: int, compressor: str, granularity: str) -> str:
    try:
        CompressionState(compressor, granularity=granularity)  # type: ignore[arg-type]
    except ValueError as e:
        return str(e)
    return "no error"


def test_bucket_granularity_mistakes_are_one_line_errors() -> None:
    unknown, lowrank = (
        spawn(_refusal, 1, args)[0]
        for args in [("top_k[k=4]", "layer"), ("power_sgd[rank=2,shared=true]", "bucket")]
    )
    assert unknown.startswith("granularity must be one of tensor, bucket")
    assert "'layer'" in unknown
    assert lowrank.startswith("granularity='bucket' compresses every DDP bucket as one flat")
    assert "use granularity='tensor'" in lowrank
    assert "\n" not in unknown + lowrank
    from shrinkgrad.network import hook_collectives  # the network model refuses the same

    for (compressor, granularity), message in zip(
        [("top_k[k=4]", "layer"), ("power_sgd[rank=2,shared=true]", "bucket")],
        [unknown, lowrank],
        strict=True,
    ):
        with pytest.raises(ValueError) as info:
            hook_collectives(compressor, [1152, 48], granularity=granularity)
        assert str(info.value) == message


def _half(rank: int, world: int, dtype: torch.dtype, fast: bool) -> dict[str, Any]:
    """A 16-bit model at bucket granularity (top-k + EF21, float32 memory), with the hook's
    16-bit fast paths on or off; its parameters per step and what it sent."""
    model = DDP(make_model(dtype), bucket_cap_mb=0.004)  # 16-bit: the same bucket count
    state = CompressionState(
        "top_k", ratio=RATIO, method="ef21", min_numel=45, granularity="bucket"
    )
    if not fast:
        state.planner.direct_half = state.planner.sparse_downcast = False
    model.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    params, sent = [], []
    for step in range(4):
        X, y = _batch(rank, step, dtype)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
        sent.append(state.last_step_bytes)
    return {"params": params, "sent": sent, "sizes": [p.numel for p in state.planner.plans]}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_16_bit_model_at_bucket_granularity_sends_16_bit_values(dtype: torch.dtype) -> None:
    """Every rank ends each step with the same 16-bit parameters; a compressed step sends
    ⌈bits(d_bucket, dtype)/8⌉ bytes per bucket (16-bit values); the 16-bit fast paths (the
    compressor reading the bfloat16 bucket itself, the changed entries only converted) give
    the bits of the dense conversions."""
    fast = spawn(_half, 2, (dtype, True))
    slow = spawn(_half, 2, (dtype, False))
    sizes = fast[0]["sizes"]
    assert len(sizes) >= 2
    want = sum(
        math.ceil(make_compressor(f"top_k[k={math.ceil(RATIO * d)}]").bits(d, dtype) / 8)
        for d in sizes
    )
    for r in range(2):
        assert fast[r]["sent"][1:] == [want] * 3
        for t in range(4):
            assert fast[r]["params"][t].dtype == dtype
            assert torch.equal(fast[r]["params"][t], fast[0]["params"][t])
            assert torch.equal(fast[r]["params"][t], slow[r]["params"][t]), (r, t)
    assert not torch.equal(fast[0]["params"][0], fast[0]["params"][-1])


@pytest.mark.parametrize(
    "case,message",
    [
        ("partial", "holds some tensors of the bucket of tensors #0, #1 but not [1]"),
        ("rounds", "have method states of different rounds [1, 2]"),
        ("structure", "have method states of other structures"),
        ("shared", "differ in 'server.w', which is not per-entry state"),
    ],
)
def test_a_bucket_unit_is_not_joined_from_entries_that_do_not_fit(case: str, message: str) -> None:
    """Joining a bucket unit of tensors #0 (3 entries) and #1 (2 entries) from their pending
    entries refuses, naming the bucket: an entry missing (a checkpoint of another model), other
    rounds, other leaves, or a leaf that is not per-entry (not split along the tensor) but
    differs between them — never a silently mixed state."""
    from shrinkgrad.distributed.hooks.memory import Memory
    from shrinkgrad.distributed.hooks.plan import GROUP_BASE

    def template(uid: int) -> Any:
        raise AssertionError("a refused join builds no state")

    g3, g2, w = torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1)
    pending = {
        "partial": {0: (1, {"clients.g": g3})},
        "rounds": {0: (1, {"clients.g": g3}), 1: (2, {"clients.g": g2})},
        "structure": {0: (1, {"clients.g": g3}), 1: (1, {"clients.h": g2})},
        "shared": {
            0: (1, {"clients.g": g3, "server.w": w}),
            1: (1, {"clients.g": g2, "server.w": 2 * w}),
        },
    }[case]
    memory = Memory(template)
    memory.groups[GROUP_BASE] = ((0, 3), (1, 2))
    memory.pending = dict(pending)
    with pytest.raises(RuntimeError) as info:
        memory.get(GROUP_BASE)
    assert message in str(info.value)
    assert "the bucket of tensors #0, #1" in str(info.value)


class _Bucket:
    """What the planner reads of a GradBucket: its index, parameters and flat buffer."""

    def __init__(self, index: int, params: list[torch.Tensor]) -> None:
        self._index, self._params = index, params
        self._buf = torch.cat([p.detach().reshape(-1) for p in params])

    def index(self) -> int:
        return self._index

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def buffer(self) -> torch.Tensor:
        return self._buf


def test_the_saved_layout_regroups_a_bucket_that_holds_its_units_otherwise() -> None:
    """The planner's bookkeeping behind a restart at bucket granularity: ``layout()`` is the
    units of DDP's current buckets (a regrouped bucket's older plans are dropped), and with a
    saved layout as ``hint`` a bucket holding whole saved units in another order is staged in
    the units' order (and written back in DDP's), while one that does not is compressed as
    DDP groups it."""
    assert spawn(_layout_checks, 1, ()) == [True]


def _layout_checks(rank: int, world: int) -> bool:
    a, b, c, d = (torch.full((n,), float(i)) for i, n in enumerate((100, 60, 80, 50)))
    planner = CompressionState("top_k", ratio=RATIO, min_numel=45, granularity="bucket").planner

    def plan(index: int, params: list[torch.Tensor]) -> Any:
        bucket = _Bucket(index, params)
        return planner.plan(bucket, 0), bucket.buffer()  # type: ignore[arg-type]

    plan(0, [a, b]), plan(1, [c, d])  # canonical ids in order of first sight: a 0 ... d 3
    assert planner.layout() == [[0, 1], [2, 3]]
    plan(0, [d, c, b, a])  # regrouped into one bucket: the plan of index 1 is stale
    assert planner.layout() == [[3, 2, 1, 0]] and len(planner.plans) == 1
    plan(0, [d, c]), plan(1, [b, a])
    assert planner.layout() == [[3, 2], [1, 0]]

    planner.hint = ((3, 2), (1, 0))  # a restarted job: DDP's first bucket holds everything
    p, buf = plan(0, [a, b, c, d])
    assert p.groups == ((3, 2), (1, 0)) and [u.members for u in p.units] == [
        ((3, 50), (2, 80)),
        ((1, 60), (0, 100)),
    ]
    staged = p.stage(buf)
    want = torch.cat([d, c, b, a])
    assert staged is not buf and torch.equal(staged, want)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(want * 2)
    assert torch.equal(p.unstage(buf, done), torch.cat([a, b, c, d]) * 2)

    p, buf = plan(0, [a, b, c])  # not whole saved units: DDP's grouping, nothing staged
    assert p.groups == ((0, 1, 2),) and p.staged is None and p.stage(buf) is buf
    p, _ = plan(0, [d, c])  # exactly a saved unit: nothing staged either
    assert p.groups == ((3, 2),) and p.staged is None
    planner.sealed = True  # DDP rebuilt its buckets: a new one is compressed as DDP groups it
    p, _ = plan(0, [c, d, a, b])
    assert p.groups == ((2, 3, 0, 1),) and p.staged is None
    p, _ = plan(0, [a, b, c, d])  # a bucket of the initial layout still is the saved units
    assert p.groups == ((3, 2), (1, 0)) and p.staged is not None
    return True
