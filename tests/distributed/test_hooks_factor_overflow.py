"""A float16 PowerSGD factor that overflows in the DDP hook (``power_sgd[shared=true]``).

The factors travel in the gradients' dtype and grow with the singular values of the matrix,
not with its entries: for rank 1's 40 × 48 gradient set to the constant c (finite in float16),
M_1 ≈ c·1 1ᵀ has σ₁ = c·√(40·48), and Q_1 = M_1ᵀ P̂ (P̂ ≈ 1/√40, a unit column) has entries
c·√40, beyond float16's 65504 for c = 12000 (a single-step overflow of Q_i); with c = 1000
(Q_1 ≈ 6300, finite) EF21's g_1 and the next Q both grow to that size, and the next P_1 = M_1 Q,
about σ₁(M_1)·σ₁(Q), overflows at the following step, whatever that step's gradient (P).

* without a loss scaler every rank stops with one line naming the factor and the fix (it used
  to hand DDP NaN gradients silently for P, and for Q_i to take the inf into g_i and the next Q
  and stop one step later with a generic "non-finite entries");
* with a loss scaler the step is skipped on every rank and the hook's memory (Q, g_i, g) is that
  of before it, bit for bit, and a warning says that a smaller loss scale cannot help.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import pytest
import torch
from ddp_helpers import _batch, make_model
from torch.nn.parallel import DistributedDataParallel as DDP

from shrinkgrad.distributed import CompressionState, WorkerError, compression_hook, spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

COMPRESSOR = "power_sgd[rank=1,shared=true]"
WEIGHT = 2  # the (40, 48) weight: a compressed tensor (tensor #2)


class FixedScale:
    """A loss scaler that never changes (what GradScaler does between its updates)."""

    def get_scale(self) -> float:
        return 1.0


@dataclasses.dataclass
class Job:
    value: float | None  # rank 1's gradient of the weight is this constant at step ``at``
    at: int = 2
    steps: tuple[int, ...] = (0, 1, 2, 3, 4)
    scaler: bool = False
    summation: str = "auto"  # float16 + EF21's float32 memory: the factors all-gathered


def _memory(state: CompressionState) -> dict[str, torch.Tensor]:
    return {
        f"{uid}.{k}": t.clone()
        for uid, v in state.state_dict()["memory"].items()
        for k, t in v["state"].items()
        if isinstance(t, torch.Tensor)
    }


def _train(rank: int, world: int, job: Job) -> dict[str, Any]:
    """EF21 + shared PowerSGD on a float16 model; like GradScaler, a step whose gradients are
    not finite is skipped. Returns the parameters, the skipped steps, the hook memory after
    every step and the warnings."""
    model = DDP(make_model(torch.float16), bucket_cap_mb=0.01)
    state = CompressionState(
        COMPRESSOR,
        method="ef21",
        min_numel=45,
        scaler=FixedScale() if job.scaler else None,
        summation=job.summation,  # type: ignore[arg-type]
    )
    model.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    weight = list(model.parameters())[WEIGHT]
    assert weight.shape == (40, 48)
    skipped, memories = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in job.steps:
            X, y = _batch(rank, step, torch.float16)
            opt.zero_grad()
            handle = None
            if step == job.at and rank == 1 and job.value is not None:
                handle = weight.register_hook(
                    functools.partial(torch.full_like, fill_value=job.value)
                )
            torch.nn.functional.cross_entropy(model(X), y).backward()
            if handle is not None:
                handle.remove()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            memories.append(_memory(state))
            if not all(bool(torch.isfinite(g).all()) for g in grads):
                skipped.append(step)
                continue
            opt.step()
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
        "skipped": skipped,
        "memories": memories,
        "overflows": state.overflows,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)],
    }


def _one_line_factor_error(text: str, *factors: str) -> None:
    """Every rank's error line names the factor (``factors``: rank 0's, rank 1's), the
    tensor, float16's range and the fixes; no generic non-finite message."""
    for r in range(2):
        line = next(x for x in text.splitlines() if x.strip().startswith(f"rank {r}:"))
        factor = factors[min(r, len(factors) - 1)]
        assert f"the low-rank factor {factor} of tensor #{WEIGHT} (40 x 48) overflows " in line
        assert "float16's range (±65504)" in line and "every gradient entry is finite" in line
        assert "bfloat16" in line and "float32" in line and "scaler=" in line
    assert "non-finite entries" not in text and "non-finite gradient" not in text


def test_without_a_scaler_a_q_factor_overflow_stops_every_rank_in_one_line() -> None:
    """Rank 1's Q_1 overflows; rank 0's own Q_0 is finite and it learns of it from Q̄."""
    with pytest.raises(WorkerError) as info:
        spawn(_train, 2, (Job(12000.0),), pg_timeout=20.0)
    _one_line_factor_error(
        str(info.value), "Q̄ = Σ_i Q_i / n (a rank's Q_i or the sum)", "Q_i = M_iᵀ P̂"
    )


@pytest.mark.parametrize("summation", ["gather", "reduce"])
def test_without_a_scaler_a_p_factor_overflow_stops_every_rank_in_one_line(
    summation: str,
) -> None:
    """Step 2 (c = 1000) is finite everywhere; step 3's P_1 overflows. It used to give DDP NaN
    gradients with no error (a training loop would step into NaN)."""
    with pytest.raises(WorkerError) as info:
        spawn(_train, 2, (Job(1000.0, steps=(0, 1, 2, 3), summation=summation),), pg_timeout=20.0)
    _one_line_factor_error(str(info.value), "P = Σ_i M_i Q")


def test_with_a_scaler_the_step_is_skipped_and_the_memory_kept() -> None:
    """Q_1 overflows at step 2: every rank skips it, the memory after it is the memory before
    it (Q, every g_i and g, bit for bit), and the run ends where the run without step 2 does;
    a warning names the factor."""
    hit = spawn(_train, 2, (Job(12000.0, scaler=True),))
    ref = spawn(_train, 2, (Job(None, steps=(0, 1, 3, 4), scaler=True),))
    for r in range(2):
        assert hit[r]["skipped"] == [2] and hit[r]["overflows"] == 1
        before, after = hit[r]["memories"][1], hit[r]["memories"][2]
        assert before.keys() == after.keys() and any("compressor_state" in k for k in before)
        for k in before:
            assert torch.equal(before[k], after[k]), k
            assert bool(torch.isfinite(after[k]).all()), k
        assert torch.equal(hit[r]["params"], ref[r]["params"])
        assert ref[r]["skipped"] == [] and ref[r]["warnings"] == []
    assert any("factor Q_i = M_iᵀ P̂ of tensor #2" in w for w in hit[1]["warnings"])
    assert any("a smaller loss scale does not help" in w for w in hit[1]["warnings"])


def test_with_a_scaler_a_lasting_p_overflow_is_skipped_every_step_and_said() -> None:
    """After step 2 (c = 1000, finite) every P_1 overflows: the hook compresses the unscaled
    gradient, so the scaler skips every later step, and the warning says that this repeats."""
    hit = spawn(_train, 2, (Job(1000.0, scaler=True),))
    for r in range(2):
        assert hit[r]["skipped"] == [3, 4] and hit[r]["overflows"] == 2
        kept = hit[r]["memories"][2]  # after the last step taken
        for mem in hit[r]["memories"][3:]:  # the skipped ones change nothing of it
            assert mem.keys() == kept.keys()
            assert all(torch.equal(mem[k], kept[k]) for k in kept)
            assert all(bool(torch.isfinite(t).all()) for t in mem.values())
    assert any("factor P_i = M_i Q of tensor #2" in w for w in hit[1]["warnings"])
