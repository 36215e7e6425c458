"""The 16-bit fast paths of the hook give the bits of the paths before them (issue 14).

Two fast paths for bfloat16/float16 models with the method kept in float32 (the default):

* a bfloat16 bucket read by the compressors themselves (``Planner.direct_half``): no float32
  copy of a compressed tensor's gradient, for methods whose first use of the gradient is the
  compressor call (``Method.compresses_gradient_first``: DCGD, EF21);
* a float32 direction converted into the 16-bit output only at the entries its method reports
  changed (``Planner.sparse_downcast``, ``Method.direction_changes``: EF21's g at the aggregate's
  n·k indices) instead of a dense downcast;
* for a bfloat16 output, those entries written by EF21's server sparse add itself, in its pass
  (``Planner.fused_mirror``: the hook's ``Config.mirror``, ``_kernels.sparse_add_bf16_at``).

Both claim the same bits as the dense paths (a bfloat16 widens to float32 exactly; the
conversion of an unchanged entry is the one already there). Every rank (2 forked gloo ranks,
their own data) trains the same model twice, the fast paths on and off, and every step's
parameters and the final method states must be equal bit for bit. Before every step the
float32 copies are poisoned with NaN, so a method that read an unfilled copy would show; a
deliberately wrong changed-entry list, or a fused add that forgets its mirror, must be caught
by the same comparison.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from shrinkgrad.compressors import _kernels as K
from shrinkgrad.distributed import CompressionState, compression_hook, spawn
from shrinkgrad.distributed.hooks.plan import Plan
from shrinkgrad.methods.ef21 import EF21

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]

STEPS = 5
#: one weight of 512·160 entries (Top-k's sampled, fused kernels need d ≥ 2¹⁶), one short one
#: (Top-k's direct selection), biases below min_numel (sent uncompressed)
WIDTHS = (512, 160, 10)


@dataclasses.dataclass(frozen=True)
class Case:
    method: str
    compressor: str
    dtype: torch.dtype
    #: the bfloat16 bucket is read by the compressor itself (the copy stays unfilled)
    direct: bool
    #: the direction is converted at its changed entries only
    changes: bool

    @property
    def fused(self) -> bool:
        """Those entries are written by the server's sparse add (a bfloat16 output of EF21)."""
        return self.changes and self.dtype == torch.bfloat16

    @property
    def label(self) -> str:
        return f"{self.method}-{self.compressor}-{str(self.dtype).removeprefix('torch.')}"


def _cases() -> list[Case]:
    out = []
    for dtype in (torch.bfloat16, torch.float16):
        bf16 = dtype == torch.bfloat16
        for method in ("ef21", "ef21_sgdm[beta=0.5]", "ef"):
            ef21 = method.startswith("ef21")
            for comp in ("top_k", "rand_k_scaled[shared_seed=true]"):
                # EF21 reads ∇f_i first through the fused Top-k difference; with shared-seed
                # rand-k it forms ∇f_i − g_i itself (the copy is filled); EF-SGDM and EF read ∇f_i
                # densely first
                direct = bf16 and method == "ef21" and comp == "top_k"
                out.append(Case(method, comp, dtype, direct, ef21))
        for comp in ("top_k", "rand_k[shared_seed=true]"):
            out.append(Case("dcgd[biased=true]", comp, dtype, bf16, False))
    return out


CASES = _cases()


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTHS[0], WIDTHS[1]),
        torch.nn.Tanh(),
        torch.nn.Linear(WIDTHS[1], WIDTHS[2]),
    ).to(dtype)


def _leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return [t for k in value._fields for t in _leaves(getattr(value, k))]
    return [value] if isinstance(value, torch.Tensor) and value.ndim else []


def _train(rank: int, case: Case, fast: bool, fused: bool = True) -> dict[str, Any]:
    """STEPS steps of ``case`` on this rank's data: the parameters after every step, the method
    states, and what the fast paths did (copies left unfilled, entry-wise writes, fused sparse
    adds). ``fused=False``: the fast paths without the fused mirror."""
    model = DDP(_model(case.dtype), bucket_cap_mb=0.1)  # several buckets
    state = CompressionState(
        case.compressor, ratio=0.01, method=case.method, min_numel=200, warmup_steps=1, seed=5
    )
    state.planner.direct_half = state.planner.sparse_downcast = fast
    state.planner.fused_mirror = fused
    model.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    params, unfilled, writes, adds = [], 0, [0], [0]
    real = Plan.write_changes
    real_add = K.sparse_add_bf16_at

    def counted(self: Plan, *args: Any) -> bool:
        done = real(self, *args)
        writes[0] += done
        return done

    def counted_add(*args: Any) -> bool:
        adds[0] += 1
        return bool(real_add(*args))

    Plan.write_changes = counted  # type: ignore[method-assign]
    K.sparse_add_bf16_at = counted_add
    try:
        for _ in range(STEPS):
            X = torch.randn(16, WIDTHS[0], generator=gen).to(case.dtype)
            y = torch.randint(0, WIDTHS[-1], (16,), generator=gen)
            for plan in state.planner.plans:  # a read of an unfilled copy shows as NaN
                if plan.wide is not None:
                    plan.wide.fill_(float("nan"))
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(X), y).backward()
            opt.step()
            params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
            unfilled += sum(
                bool(u.slice(plan.wide).isnan().all())
                for plan in state.planner.plans
                if plan.wide is not None
                for u in plan.compressed
            )
    finally:
        Plan.write_changes = real  # type: ignore[method-assign]
        K.sparse_add_bf16_at = real_add
    memory = {
        uid: _leaves(st.server) + _leaves(st.clients) for uid, st in state.memory.states.items()
    }
    # what DDP received in the last step (the direction in the model's dtype)
    outputs = [p.out.clone() for p in state.planner.plans if p.out is not None]
    return {
        "params": params,
        "memory": memory,
        "outputs": outputs,
        "unfilled": unfilled,
        "writes": writes[0],
        "adds": adds[0],
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if len(a["params"]) != len(b["params"]) or a["memory"].keys() != b["memory"].keys():
        return False
    if not all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True)):
        return False
    if len(a["outputs"]) != len(b["outputs"]) or not all(
        torch.equal(_bits(x), _bits(y)) for x, y in zip(a["outputs"], b["outputs"], strict=True)
    ):
        return False
    for uid, leaves in a["memory"].items():
        other = b["memory"][uid]
        if len(leaves) != len(other) or not all(
            x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(leaves, other, strict=True)
        ):
            return False
    return True


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}
    return t.view(ints.get(t.dtype, torch.int16))


def _on_ranks(rank: int, world: int, cases: list[Case], wrong: str | None) -> dict[str, Any]:
    """Every case with the fast paths on and off (and, where the fused mirror applies, on
    without it). ``wrong`` (mutations the comparison must catch): ``"changes"``, EF21's
    changed-entry list drops its last entries (the fused mirror off: it writes every entry
    it adds to, whatever the list says); ``"mirror"``, the fused add leaves the mirror
    unwritten."""
    if wrong == "changes":
        real = EF21.direction_changes

        def truncated(self: EF21, cfg: Any, aggregate: Any) -> torch.Tensor | None:
            idx = real(self, cfg, aggregate)
            return None if idx is None else idx[: idx.numel() // 2]

        EF21.direction_changes = truncated  # type: ignore[method-assign]
    if wrong == "mirror":

        def forgetful(out: Any, idx: Any, vals: Any, negate: bool, mirror: Any) -> bool:
            return bool(K.sparse_add(out, idx, vals, negate))

        K.sparse_add_bf16_at = forgetful
    out = {}
    for case in cases:
        fast = _train(rank, case, True, fused=wrong != "changes")
        slow = _train(rank, case, False)
        unfused = _train(rank, case, True, fused=False) if case.fused and not wrong else fast
        out[case.label] = {
            "same": _same(fast, slow),
            "same_unfused": _same(fast, unfused),
            "finite": bool(torch.isfinite(fast["params"][-1]).all()),
            "moved": not torch.equal(fast["params"][0], fast["params"][-1]),
            "unfilled": fast["unfilled"],
            "slow_unfilled": slow["unfilled"],
            "writes": fast["writes"],
            "slow_writes": slow["writes"],
            "adds": fast["adds"],
            "other_adds": slow["adds"] + (unfused["adds"] if unfused is not fast else 0),
            "unfused_writes": unfused["writes"],
        }
    return out


def test_the_16_bit_fast_paths_give_the_bits_of_the_dense_paths() -> None:
    got = spawn(_on_ranks, 2, (CASES, None), timeout=220.0)
    for case in CASES:
        for rank in range(2):
            r = got[rank][case.label]
            assert r["same"], f"{case.label}, rank {rank}: the fast paths changed the bits"
            assert r["same_unfused"], f"{case.label}, rank {rank}: the fused mirror changed them"
            # the fused mirror ran where it applies (every compressed round), and only there
            if case.fused:
                assert r["adds"] > 0 and r["other_adds"] == 0, case.label
                assert r["unfused_writes"] > 0, case.label
            else:
                assert r["adds"] == 0, case.label
            assert r["finite"] and r["moved"], case.label
            assert r["slow_unfilled"] == 0 and r["slow_writes"] == 0, case.label
            # the fast paths were taken where they apply, and only there
            if case.direct:
                assert r["unfilled"] > 0, f"{case.label}: the float32 copy was made"
            else:
                assert r["unfilled"] == 0, case.label
            if case.changes:
                assert r["writes"] > 0, f"{case.label}: the direction was converted densely"
            else:
                assert r["writes"] == 0, case.label


@pytest.mark.parametrize("wrong", ["changes", "mirror"])
def test_a_wrong_changed_entry_list_or_mirror_is_caught(wrong: str) -> None:
    """The comparison above fails when EF21 reports only half of its changed entries, or when
    the fused sparse add of a bfloat16 model does not write the mirror it claims."""
    cases = [c for c in CASES if c.method == "ef21" and c.compressor == "top_k"]
    if wrong == "mirror":
        cases = [c for c in cases if c.fused]
    got = spawn(_on_ranks, 2, (cases, wrong), timeout=220.0)
    for case in cases:
        assert got[0][case.label]["writes"] > 0
        assert not got[0][case.label]["same"], f"{case.label}: the mutation went unnoticed"
