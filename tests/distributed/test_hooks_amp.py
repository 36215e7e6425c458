"""DDP hooks with a loss scaler (``CompressionState(scaler=...)``): the memory holds true
gradients, and an overflowing step is skipped on every rank as if it had not happened."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from ddp_helpers import _batch, make_model
from torch.nn.parallel import DistributedDataParallel as DDP

from shrinkgrad.distributed import CompressionState, WorkerError, compression_hook, spawn

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

SCALE = 2.0**8


class FixedScale:
    """A loss scaler that never changes (what GradScaler does between its updates)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def get_scale(self) -> float:
        return self.scale


@dataclasses.dataclass
class AmpJob:
    compressor: str
    ratio: float | None = None
    error_feedback: str = "none"
    momentum: float = 0.0
    steps: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
    overflow_at: int | None = None  # rank 1's last-layer gradient becomes inf at this step
    overflow_param: int = -2  # which parameter: the last weight (-1: the last bias, uncompressed)
    scale: float | None = SCALE  # None: no scaler
    granularity: str = "tensor"
    bucket_cap_mb: float = 0.01  # several buckets (one per bucket unit: 0.004 gives two)
    load: str | None = None  # checkpoint to resume from (model, optimizer, hook)
    save: str | None = None  # checkpoint to write after the last step


def _train(rank: int, world: int, job: AmpJob) -> dict[str, Any]:
    """Loss × scale, backward through the hook, then like GradScaler: skip the step when a
    gradient is not finite, else divide the gradients by the scale and step."""
    model = DDP(make_model(), bucket_cap_mb=job.bucket_cap_mb)
    scaler = None if job.scale is None else FixedScale(job.scale)
    state = CompressionState(
        job.compressor,
        ratio=job.ratio,
        error_feedback=job.error_feedback,  # type: ignore[arg-type]
        min_numel=45,
        momentum=job.momentum,
        scaler=scaler,
        granularity=job.granularity,  # type: ignore[arg-type]
    )
    model.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    if job.load is not None:
        ckpt = torch.load(f"{job.load}.rank{rank}", weights_only=False)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        state.load_state_dict(ckpt["hook"])
    last = list(model.parameters())[job.overflow_param]  # (-2: one bucket of several)
    skipped, nan_grads = [], []
    for step in job.steps:
        X, y = _batch(rank, step, torch.float32)
        opt.zero_grad()
        handle = None
        if step == job.overflow_at and rank == 1:
            handle = last.register_hook(lambda g: g * float("inf"))
        loss = torch.nn.functional.cross_entropy(model(X), y)
        (loss * (job.scale or 1.0)).backward()
        if handle is not None:
            handle.remove()
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None for g in grads)
        if not all(bool(torch.isfinite(g).all()) for g in grads if g is not None):
            skipped.append(step)
            nan_grads.append(bool(torch.isnan(last.grad).all()) if last.grad is not None else False)
            continue
        for g in grads:
            if g is not None:
                g.div_(job.scale or 1.0)
        opt.step()
    if job.save is not None:
        ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict()}
        torch.save(ckpt | {"hook": state.state_dict()}, f"{job.save}.rank{rank}")
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {
        "params": params,
        "skipped": skipped,
        "nan_grads": nan_grads,
        "iteration": state.state_dict()["iteration"],
        "overflows": state.overflows,
    }


CONFIGS = [
    pytest.param(AmpJob("top_k", ratio=0.1, error_feedback="ef21"), id="top_k-ef21"),
    pytest.param(
        AmpJob("top_k", ratio=0.1, error_feedback="ef21", momentum=0.5), id="top_k-ef21-sgdm"
    ),
    pytest.param(AmpJob("rand_k_scaled", ratio=0.2, error_feedback="ef"), id="rand_k_scaled-ef"),
    pytest.param(AmpJob("rand_k[shared_seed=true]", ratio=0.2), id="rand_k-shared"),
    pytest.param(AmpJob("strat_k[shared_seed=true]", ratio=0.2), id="strat_k-shared"),
    pytest.param(AmpJob("qsgd[s=4]"), id="qsgd"),
    pytest.param(AmpJob("bernoulli[p=0.2]"), id="bernoulli-variable-size"),
    pytest.param(AmpJob("identity", error_feedback="ef21"), id="identity-ef21"),
]


@pytest.mark.parametrize("job", CONFIGS)
@pytest.mark.parametrize("at", [0, 2])  # in the dense warm-up step, and later
def test_an_overflowing_step_is_skipped_as_if_it_had_not_happened(job: AmpJob, at: int) -> None:
    _check_skipped(job, at)


@pytest.mark.parametrize("at", [0, 1, 2])
def test_an_overflow_is_undone_at_bucket_granularity_through_the_bucket_rebuild(at: int) -> None:
    """``granularity="bucket"``: at step 1, the first one in DDP's rebuilt buckets, the new
    bucket units are joined from the split states of the old ones; an overflow there drops
    them and puts the split entries back, so that step 2 joins them again (at 0: the
    initialisation; at 2: a step within one layout)."""
    _check_skipped(AmpJob("top_k", ratio=0.1, error_feedback="ef21", granularity="bucket"), at)


@pytest.mark.parametrize("granularity", ["tensor", "bucket"])
def test_an_overflow_in_the_first_step_after_a_restore_keeps_the_checkpoint(
    granularity: str, tmp_path: Path
) -> None:
    """A restored memory waits as pending entries until its units are first planned; the
    first step after the restore builds the states from them. When that step overflows, the
    undo drops those states and must put the entries back (else the memory is lost and the
    next step initialises afresh): resumed with an overflow at step 3, the run ends where a
    resumed run without step 3 does, and where a run without step 3 and without a restart
    does (per bucket, the resumed runs' first step gets DDP's initial layout, the parameters
    in model order, and the scaler's path compresses the checkpoint's units from it)."""
    cap = 0.004 if granularity == "bucket" else 0.01  # two bucket units after the rebuild
    job = AmpJob("top_k", ratio=0.1, error_feedback="ef21", granularity=granularity)
    job = dataclasses.replace(job, bucket_cap_mb=cap)
    prefix = str(tmp_path / "ckpt")
    spawn(_train, 2, (dataclasses.replace(job, steps=(0, 1, 2), save=prefix),))
    rest = dataclasses.replace(job, steps=(3, 4, 5), load=prefix)
    hit = spawn(_train, 2, (dataclasses.replace(rest, overflow_at=3),))
    clean = spawn(_train, 2, (dataclasses.replace(rest, steps=(4, 5)),))
    straight = spawn(_train, 2, (dataclasses.replace(job, steps=(0, 1, 2, 4, 5)),))
    for r in range(2):
        assert hit[r]["skipped"] == [3] and hit[r]["overflows"] == 1
        assert hit[r]["iteration"] == clean[r]["iteration"] == 5
        assert torch.equal(hit[r]["params"], clean[r]["params"])
        assert torch.equal(clean[r]["params"], straight[r]["params"])


def _check_skipped(job: AmpJob, at: int) -> None:
    """A run whose step ``at`` overflows on rank 1 ends where a run without that step does."""
    hit = spawn(_train, 2, (dataclasses.replace(job, overflow_at=at),))
    steps = tuple(s for s in job.steps if s != at)
    clean = spawn(_train, 2, (dataclasses.replace(job, steps=steps),))
    for r in range(2):
        assert hit[r]["skipped"] == [at]  # every rank saw the overflow ...
        assert hit[r]["nan_grads"] == [True]  # ... as NaN in the overflowing bucket
        assert hit[r]["overflows"] == 1
        assert hit[r]["iteration"] == clean[r]["iteration"] == len(steps)
        assert clean[r]["skipped"] == []
        assert torch.equal(hit[r]["params"], clean[r]["params"])


@pytest.mark.parametrize(
    "job",
    [
        AmpJob("top_k", ratio=0.1, error_feedback="ef21", momentum=0.5),
        AmpJob("rand_k_scaled", ratio=0.2, error_feedback="ef"),
        AmpJob("identity"),
    ],
    ids=["top_k-ef21-sgdm", "rand_k_scaled-ef", "identity"],
)
def test_a_power_of_two_loss_scale_changes_nothing(job: AmpJob) -> None:
    """The hook divides by the scale and multiplies back: with a power of two both are exact,
    so a scaled run gives the unscaled run's parameters bit for bit."""
    scaled = spawn(_train, 2, (job,))
    plain = spawn(_train, 2, (dataclasses.replace(job, scale=None),))
    for r in range(2):
        assert torch.equal(scaled[r]["params"], plain[r]["params"])


def test_without_a_scaler_an_overflow_stops_every_rank() -> None:
    job = AmpJob("top_k", ratio=0.1, error_feedback="ef21", scale=None, overflow_at=2)
    with pytest.raises(WorkerError, match="non-finite"):
        spawn(_train, 2, (job,), pg_timeout=20.0)


def test_without_a_scaler_an_overflow_in_the_dense_first_step_is_blamed_on_its_rank() -> None:
    """Rank 1's inf at step 0 (EF21's dense initialisation): rank 1 stops naming itself; rank 0,
    whose gradients were finite, fails in the collective — it used to take the NaN sum into its
    EF21 state and report its own 'non-finite input' one step later."""
    job = AmpJob("top_k", ratio=0.1, error_feedback="ef21", scale=None, overflow_at=0)
    with pytest.raises(WorkerError) as info:
        spawn(_train, 2, (job,), pg_timeout=20.0)
    text = str(info.value)
    assert "rank 1: this rank's gradients hold inf or nan in a dense iteration" in text
    assert "rank 0: ValueError" not in text


@pytest.mark.parametrize("error_feedback", ["ef21", "ef"])
def test_without_a_scaler_an_overflow_in_an_uncompressed_tensor_stops_its_rank(
    error_feedback: str,
) -> None:
    """Rank 1's inf in the last bias (4 entries, below min_numel: sent uncompressed) at step 2:
    rank 1 stops naming itself and the tensor. It used to go on the wire silently and leave
    EF21's g (EF's e) of that tensor non-finite for the rest of the run."""
    job = AmpJob(
        "top_k", ratio=0.1, error_feedback=error_feedback, scale=None, overflow_at=2,
        overflow_param=-1,
    )  # fmt: skip
    with pytest.raises(WorkerError) as info:
        spawn(_train, 2, (job,), pg_timeout=20.0)
    assert "rank 1: the gradient of" in str(info.value)
    assert "(sent uncompressed) holds inf or nan" in str(info.value)


def _train_amp(rank: int, world: int) -> dict[str, Any]:
    """torch.amp.GradScaler itself, started at a scale that overflows."""
    model = DDP(make_model(), bucket_cap_mb=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**125, backoff_factor=2.0**-16)
    state = CompressionState("top_k", ratio=0.1, error_feedback="ef21", scaler=scaler)
    model.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    scales, losses = [], []
    for step in range(8):
        X, y = _batch(rank, step, torch.float32)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(X), y)
        scaler.scale(loss * 2.0**20).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        losses.append(float(loss))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {
        "params": params,
        "scales": scales,
        "overflows": state.state_dict()["overflows"],
        "iteration": state.iteration,
    }


def test_torch_grad_scaler_skips_the_overflowing_steps_on_every_rank() -> None:
    res = spawn(_train_amp, 2)
    before = [2.0**125, *res[0]["scales"][:-1]]
    skipped = sum(b < a for a, b in zip(before, res[0]["scales"], strict=True))
    assert skipped >= 1  # the scaler did back off: some steps overflowed
    for r in range(2):
        assert res[r]["overflows"] == skipped  # the hook undid exactly those
        assert res[r]["iteration"] == 8 - skipped
        assert bool(torch.isfinite(res[r]["params"]).all())
    assert torch.equal(res[0]["params"], res[1]["params"])


def test_a_scaler_without_get_scale_is_refused() -> None:
    def check(rank: int, world: int) -> str:
        with pytest.raises(TypeError, match=r"scaler must be a torch\.amp\.GradScaler"):
            CompressionState("top_k", ratio=0.1, scaler=object())
        return "ok"

    assert spawn(check, 1) == ["ok"]
