"""``examples/ddp_mlp.py``, the example a practitioner copies: it trains, logs what it sends,
and its shrinkgrad lines do what the hook promises."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from shrinkgrad import make_compressor

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp_mlp.py"
HIDDEN = 32
WORLD = 2
STEPS = 6


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ddp_mlp", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _train(mod: ModuleType, *extra: str) -> dict[str, Any]:
    from shrinkgrad.distributed import spawn

    argv = ["--hidden", str(HIDDEN), "--steps", str(STEPS), "--log-every", "3", *extra]
    return spawn(mod.train, WORLD, (mod.parse_args(argv),), timeout=150.0)[0]


def test_identity_hook_trains_like_ddp_without_a_hook() -> None:
    mod = _example()
    plain = _train(mod, "--hook", "none")
    hooked = _train(
        mod, "--hook", "shrinkgrad", "--compressor", "identity", "--method", "dcgd",
        "--no-client-momentum",
    )  # fmt: skip
    for a, b in zip(plain["history"], hooked["history"], strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-5)
    assert plain["final_train_loss"] == pytest.approx(hooked["final_train_loss"], rel=1e-5)


def test_logged_bytes_follow_the_bits_formula() -> None:
    """Top-k 1% + EF21: one dense warm-up step, then per rank ⌈bits(d)/8⌉ bytes for each weight
    matrix of ≥ 1024 entries and 4 bytes per entry of the small tensors."""
    mod = _example()
    res = _train(mod, "--hook", "shrinkgrad", "--compressor", "top_k", "--ratio", "0.01")
    shapes = [(HIDDEN, 123), (HIDDEN,), (HIDDEN, HIDDEN), (HIDDEN,), (1, HIDDEN), (1,)]
    numel = [math.prod(s) for s in shapes]
    per_step = 0
    for d in numel:
        if d >= 1024:
            k = math.ceil(0.01 * d)
            per_step += math.ceil(make_compressor(f"top_k[k={k}]").bits(d) / 8)
        else:
            per_step += 4 * d
    dense = 4 * sum(numel)
    for row in res["history"]:
        step = row["step"]
        assert row["dense_bytes"] == dense * step * WORLD
        assert row["bytes_sent"] == WORLD * (dense + (step - 1) * per_step)
    # it learns: below the loss of predicting 1/2 everywhere
    assert math.isfinite(res["final_train_loss"]) and res["final_train_loss"] < math.log(2)


def test_bucket_granularity_sends_one_vector_per_bucket() -> None:
    """--granularity bucket: the whole model is one DDP bucket (25 MB cap), so after the dense
    warm-up step every rank sends ⌈bits(d)/8⌉ bytes of one top-k of all d parameters."""
    mod = _example()
    res = _train(
        mod, "--hook", "shrinkgrad", "--compressor", "top_k", "--ratio", "0.01",
        "--granularity", "bucket",
    )  # fmt: skip
    d = HIDDEN * 123 + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN + 1
    per_step = math.ceil(make_compressor(f"top_k[k={math.ceil(0.01 * d)}]").bits(d) / 8)
    for row in res["history"]:
        assert row["bytes_sent"] == WORLD * (4 * d + (row["step"] - 1) * per_step)
    assert math.isfinite(res["final_train_loss"]) and res["final_train_loss"] < math.log(2)


def test_mixed_precision_with_the_grad_scaler_trains_like_float32() -> None:
    """--amp: float16 autocast and torch.amp.GradScaler handed to the state. Had the hook not
    multiplied the aggregate back by the scale, the steps would be 65536 times too small."""
    mod = _example()
    args = ("--hook", "shrinkgrad", "--compressor", "top_k", "--ratio", "0.01")
    fp32 = _train(mod, *args)
    amp = _train(mod, *args, "--amp")
    start = math.log(2)  # about where the untrained model starts
    assert fp32["final_train_loss"] < start - 0.05
    assert abs(amp["final_train_loss"] - fp32["final_train_loss"]) < 0.01
    assert amp["overflows"] == 0


def test_a_configuration_mistake_is_one_message_not_a_traceback() -> None:
    mod = _example()
    argv = ["--nproc", "2", "--hidden", str(HIDDEN), "--steps", "2"]
    argv += ["--hook", "shrinkgrad", "--compressor", "rand_k", "--ratio", "0.01"]  # EF21 default
    with pytest.raises(SystemExit) as info:
        mod.main(argv)
    text = str(info.value.code)
    assert text.startswith("error: ") and "needs a contractive compressor" in text
    assert "scaled(rand_k" in text  # and says what to use instead


def test_a_compressor_without_k_runs_with_the_default_ratio() -> None:
    """--compressor qsgd: the default --ratio applies only to compressors with a k (it used to
    be refused with "drop ratio", which the user had not given); qsgd's ω ≥ 1 then makes EF21
    refuse it with the fix, and with a method for unbiased compressors it trains."""
    mod = _example()
    assert mod.parse_args(["--compressor", "qsgd[s=4]"]).ratio == 0.0
    assert mod.parse_args(["--compressor", "top_k"]).ratio == 0.01
    assert mod.parse_args(["--compressor", "top_k[k=5]"]).ratio == 0.0
    assert mod.parse_args(["--compressor", "scaled(strat_k[shared_seed=true])"]).ratio == 0.01
    argv = ["--nproc", "2", "--hidden", str(HIDDEN), "--steps", "2", "--compressor", "qsgd[s=4]"]
    with pytest.raises(SystemExit) as info:
        mod.main(argv)
    text = str(info.value.code)
    assert text.startswith("error: ") and "ratio" not in text
    assert "needs a contractive compressor" in text and "scaled(qsgd[s=4])" in text
    res = _train(mod, "--compressor", "qsgd[s=4]", "--method", "dcgd", "--no-client-momentum")
    assert math.isfinite(res["final_train_loss"]) and res["history"][-1]["bytes_sent"] > 0
    with pytest.raises(SystemExit, match="error: unknown compressor 'nope'"):
        mod.main(["--compressor", "nope"])
