"""simulate(): the table, determinism, checkpoint/resume, divergence and argument checks."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch
from methods_fixtures import LeastSquares, UnbiasedRandK, rand_k

from shrinkgrad.compressors import make_compressor
from shrinkgrad.methods import ProblemOracle, make_method
from shrinkgrad.sim import COLUMNS, Divergence, SimulationInterrupted, simulate


def no_time(df: pd.DataFrame) -> pd.DataFrame:
    return df.drop(columns=["time_s"])


def same_table(a: pd.DataFrame, b: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(no_time(a), no_time(b), check_exact=True)


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------
def test_table_columns_rows_and_bits(lsq: LeastSquares) -> None:
    k, d = 1, lsq.d
    res = simulate(lsq, "ef21", f"top_k[k={k}]", "theory", rounds=23, seed=1, log_every=5)
    t = res.table
    assert list(t.columns) == list(COLUMNS)
    assert t["round"].tolist() == [0, 5, 10, 15, 20, 23]
    assert res.status == "completed" and res.rounds == 23
    assert not t.isna().any().any()
    assert set(t["method"]) == {"ef21"} and set(t["compressor"]) == {"top_k[k=1]"}
    assert set(t["stepsize_rule"]) == {"stepsize_ef21"}
    assert set(t["stepsize"]) == {res.stepsize}
    assert set(t["n_clients"]) == {lsq.n} and set(t["d"]) == {d} and set(t["seed"]) == {1}
    assert set(t["dataset"]) == {"synthetic_fixture"}
    # honest bits: x⁰-gradient in full at round 0, then k values + k indices per round
    rounds = t["round"].to_numpy()
    assert (t["bits_up"] == 32 * d + rounds * k * (32 + math.ceil(math.log2(d)))).all()
    assert (t["bits_up_paper"] == 32 * d + rounds * 32 * k).all()
    assert (t["bits_down"] == 32 * d * (rounds + 1)).all()
    assert (t["time_s"].diff().dropna() >= 0).all() and t["time_s"].iloc[0] >= 0
    # the last row is the full gradient and loss at the final iterate, not the estimator g
    g = lsq.grad(res.x)
    assert t["grad_norm_sq"].iloc[-1] == pytest.approx(float(g @ g), rel=1e-14)
    assert t["loss"].iloc[-1] == pytest.approx(lsq.loss(res.x), rel=1e-14)


def test_logged_metrics_equal_a_manual_run(lsq: LeastSquares) -> None:
    res = simulate(lsq, "ef21_w", "top_k[k=2]", 0.01, rounds=12, seed=0)
    bound = make_method("ef21_w").bind(lsq, "top_k[k=2]", 0.01)
    oracle = ProblemOracle(lsq)
    state, _ = bound.init(lsq.x0(), oracle)
    expect = []
    for _ in range(13):
        g = lsq.grad(state.x)
        expect.append(float(g @ g))
        state, _ = bound.step(state, oracle)
    assert res.table["grad_norm_sq"].tolist() == pytest.approx(expect, rel=1e-13)


def test_same_seed_same_table_other_seed_other_table(lsq: LeastSquares) -> None:
    C = rand_k(2, scaled=True)
    a = simulate(lsq, "ef21_pp[p=0.5]", C, 0.01, rounds=30, seed=3, log_every=3)
    b = simulate(lsq, "ef21_pp[p=0.5]", C, 0.01, rounds=30, seed=3, log_every=3)
    c = simulate(lsq, "ef21_pp[p=0.5]", C, 0.01, rounds=30, seed=4, log_every=3)
    same_table(a.table, b.table)
    assert not a.table["grad_norm_sq"].equals(c.table["grad_norm_sq"])


def test_names_and_objects_give_the_same_run(lsq: LeastSquares) -> None:
    a = simulate(lsq, "ef21", "top_k[k=1]", "theory*2", rounds=10)
    b = simulate(lsq, make_method("ef21"), make_compressor("top_k[k=1]"), "theory*2", rounds=10)
    same_table(a.table, b.table)
    assert set(a.table["stepsize_rule"]) == {"stepsize_ef21*2"}


def test_user_x0(lsq: LeastSquares) -> None:
    x0 = [0.5] * lsq.d
    res = simulate(lsq, "gd", None, 0.01, rounds=3, x0=x0)
    assert res.table["loss"].iloc[0] == pytest.approx(
        lsq.loss(torch.tensor(x0, dtype=torch.float64))
    )
    with pytest.raises(ValueError, match="x0 must have 8 entries"):
        simulate(lsq, "gd", None, 0.01, rounds=3, x0=[1.0, 2.0])
    with pytest.raises(ValueError, match="non-finite"):
        simulate(lsq, "gd", None, 0.01, rounds=3, x0=[math.nan] * lsq.d)


def test_x0_vector_shapes(lsq: LeastSquares) -> None:
    """A row or column vector of d entries is x0; a matrix of d entries is refused (its order
    of entries is a guess), naming the reshape."""
    x0 = torch.linspace(-1.0, 1.0, lsq.d, dtype=torch.float64)
    flat = simulate(lsq, "gd", None, 0.01, rounds=3, x0=x0)
    for shaped in (x0.reshape(1, -1), x0.reshape(-1, 1)):
        same_table(simulate(lsq, "gd", None, 0.01, rounds=3, x0=shaped).table, flat.table)
    with pytest.raises(ValueError, match=r"got a \(2, 4\) array.*reshape\(-1\)"):
        simulate(lsq, "gd", None, 0.01, rounds=3, x0=x0.reshape(2, 4))


def test_float32_problem(lsq: LeastSquares) -> None:
    p = LeastSquares(dtype=torch.float32)
    res = simulate(p, "ef21", "top_k[k=1]", "theory", rounds=20)
    assert res.x.dtype == torch.float32 and res.status == "completed"
    with pytest.raises(ValueError, match=r"build it with dtype=torch\.float32"):
        simulate(lsq, "ef21", "top_k[k=1]", "theory", rounds=2, dtype="float32")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rounds": -1}, "rounds"),
        ({"log_every": 0}, "log_every"),
        ({"tol": -1.0}, "tol"),
        ({"divergence_factor": 0.5}, "divergence_factor"),
        ({"checkpoint_every": 0}, "checkpoint_every"),
        ({"dtype": "float16"}, "dtype"),
    ],
)
def test_bad_arguments(lsq: LeastSquares, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        simulate(lsq, "gd", None, 0.01, **{"rounds": 3, **kwargs})  # type: ignore[arg-type]


def test_incompatible_compressor_is_a_clear_error(lsq: LeastSquares) -> None:
    with pytest.raises(ValueError, match=r"scaled\(test_rand_k\[k=1\]\)"):
        simulate(lsq, "ef21", UnbiasedRandK(1), "theory", rounds=3)


# --------------------------------------------------------------------------------------------
# stopping
# --------------------------------------------------------------------------------------------
def test_tolerance_stops_the_run(lsq: LeastSquares) -> None:
    res = simulate(lsq, "gd", None, 1.0 / lsq.L, rounds=5000, tol=1e-10)
    gns = res.table["grad_norm_sq"]
    assert res.status == "converged" and res.rounds < 5000
    assert gns.iloc[-1] <= 1e-10 and (gns.iloc[:-1] > 1e-10).all()


def test_callback_can_stop(lsq: LeastSquares) -> None:
    res = simulate(lsq, "gd", None, 0.01, rounds=50, callback=lambda r, s: r == 10)
    assert res.status == "stopped" and res.table["round"].iloc[-1] == 10


def test_divergence_by_growth_stops_with_a_finite_table(lsq: LeastSquares) -> None:
    with pytest.warns(RuntimeWarning, match="diverged at round"):
        only_grad = Divergence(grad_factor=1e6, loss_factor=None, iterate_factor=None)
        res = simulate(lsq, "gd", None, 5.0 / lsq.L, rounds=500, divergence_factor=only_grad)
    t = res.table
    assert res.status == "diverged" and "more than 1e+06x" in res.message
    assert t["grad_norm_sq"].iloc[-1] > 1e6 * t["grad_norm_sq"].iloc[0]
    assert (t["grad_norm_sq"].iloc[:-1] <= 1e6 * t["grad_norm_sq"].iloc[0]).all()
    assert t["round"].iloc[-1] == res.rounds < 500
    assert bool(torch.isfinite(torch.tensor(t[["grad_norm_sq", "loss"]].to_numpy())).all())


@pytest.mark.parametrize(("method", "comp"), [("gd", None), ("ef21", "top_k[k=2]")])
def test_non_finite_values_stop_the_run_without_nan_rows(
    lsq: LeastSquares, method: str, comp: str | None
) -> None:
    with pytest.warns(RuntimeWarning, match="non-finite"):
        res = simulate(lsq, method, comp, 1e120, rounds=400, log_every=7, divergence_factor=None)
    t = res.table
    assert res.status == "diverged" and res.rounds < 400
    assert not t.isna().any().any()
    assert bool(torch.isfinite(torch.tensor(t[["grad_norm_sq", "loss"]].to_numpy())).all())
    # the table ends at the last round whose metrics are finite (here before the iterate blew up)
    assert t["round"].iloc[-1] <= res.rounds


# --------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------
RUN = {"method": "ef21_pp[p=0.5]", "stepsize": 0.01, "rounds": 40, "seed": 7, "log_every": 3}


def run(problem: LeastSquares, **kw: object):  # type: ignore[no-untyped-def]
    args = {**RUN, **kw}
    return simulate(problem, args.pop("method"), rand_k(2, scaled=True), **args)  # type: ignore[arg-type]


def test_resume_after_interrupt_equals_uninterrupted(lsq: LeastSquares, tmp_path: Path) -> None:
    full = run(lsq)
    path = tmp_path / "run.pt"

    def interrupt(r: int, state: object) -> None:
        if r == 21:
            raise KeyboardInterrupt

    with pytest.raises(SimulationInterrupted) as e:
        run(lsq, checkpoint=path, callback=interrupt)
    assert e.value.result.table["round"].iloc[-1] == 21
    assert path.exists() and not Path(str(path) + ".tmp").exists()
    resumed = run(lsq, checkpoint=path)
    same_table(resumed.table, full.table)
    assert torch.equal(resumed.x, full.x)
    assert torch.equal(resumed.state.clients.g, full.state.clients.g)
    assert torch.equal(resumed.bits_up, full.bits_up)
    # a completed checkpoint returns the finished run, and can be extended
    again = run(lsq, checkpoint=path)
    same_table(again.table, full.table)
    longer = run(lsq, checkpoint=path, rounds=55)
    same_table(longer.table, run(lsq, rounds=55).table)


class FlakyProblem(LeastSquares):
    """Raises KeyboardInterrupt inside the n-th gradient evaluation (mid-step)."""

    calls_before_interrupt = -1

    def client_grads(self, x: torch.Tensor) -> torch.Tensor:
        self.calls_before_interrupt -= 1
        if self.calls_before_interrupt == 0:
            raise KeyboardInterrupt
        return super().client_grads(x)


@pytest.mark.parametrize("calls", [26, 27, 28, 29])
def test_interrupt_inside_a_step_resumes_exactly(
    lsq: LeastSquares, tmp_path: Path, calls: int
) -> None:
    """Interrupts inside a step's gradient and inside a logged row's metric evaluation."""
    args = {"n": 6, "d": 8, "m": 5, "seed": 4, "spread": 8.0}
    full = run(lsq)
    flaky = FlakyProblem(**args)  # type: ignore[arg-type]
    flaky.calls_before_interrupt = calls
    path = tmp_path / "mid.pt"
    with pytest.raises(SimulationInterrupted):
        run(flaky, checkpoint=path, checkpoint_every=5)
    resumed = run(FlakyProblem(**args), checkpoint=path)  # type: ignore[arg-type]
    same_table(resumed.table, full.table)


def test_resume_after_a_hard_kill(lsq: LeastSquares, tmp_path: Path) -> None:
    """A process killed with SIGKILL (no chance to clean up) resumes from its last checkpoint."""
    path = tmp_path / "killed.pt"
    script = tmp_path / "victim.py"
    methods_dir = Path(__file__).resolve().parent.parent / "methods"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, signal, sys
            sys.path.insert(0, {str(methods_dir)!r})
            from methods_fixtures import LeastSquares, rand_k
            from shrinkgrad.sim import simulate

            def die(r, state):
                if r == 27:
                    os.kill(os.getpid(), signal.SIGKILL)

            simulate(LeastSquares(n=6, d=8, m=5, seed=4, spread=8.0), {RUN["method"]!r},
                     rand_k(2, scaled=True), {RUN["stepsize"]!r}, rounds={RUN["rounds"]},
                     seed={RUN["seed"]}, log_every={RUN["log_every"]}, checkpoint={str(path)!r},
                     checkpoint_every=4, callback=die)
            """
        )
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    from shrinkgrad.sim import load_checkpoint

    saved = load_checkpoint(path)
    assert saved is not None and saved["state"].round == 24  # the last multiple of 4 before 27
    resumed = run(lsq, checkpoint=path)
    same_table(resumed.table, run(lsq).table)


def test_checkpoint_of_another_run_is_refused(lsq: LeastSquares, tmp_path: Path) -> None:
    path = tmp_path / "a.pt"
    run(lsq, checkpoint=path, rounds=5)
    with pytest.raises(ValueError, match=r"different run \(seed: saved 7 vs now 8\)"):
        run(lsq, checkpoint=path, seed=8)
    # the same run saved without some fields (an older layout) is refused, not misread
    from shrinkgrad.sim import load_checkpoint, save_checkpoint

    saved = load_checkpoint(path)
    assert saved is not None
    save_checkpoint(path, {k: v for k, v in saved.items() if k not in ("n_rows", "last_logged")})
    with pytest.raises(
        ValueError, match=r"another version of shrinkgrad .*lacks last_logged, n_rows"
    ):
        run(lsq, checkpoint=path, rounds=5)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot read the checkpoint"):
        run(lsq, checkpoint=path)


def test_problem_by_name_takes_dtype() -> None:
    spec = "logistic_regression[dataset=australian_scale,n_clients=5]"
    res = simulate(spec, "ef21", "top_k[k=1]", "theory", rounds=4, dtype="float32")
    assert res.x.dtype == torch.float32
    assert set(res.table["dataset"]) == {"australian_scale"}
    assert set(res.table["n_clients"]) == {5} and set(res.table["d"]) == {14}
    with pytest.raises(ValueError, match="unknown problem"):
        simulate("logistic_regresion[dataset=a9a]", "ef21", "top_k[k=1]", rounds=1)


# --------------------------------------------------------------------------------------------
# the options object and the result's repr
# --------------------------------------------------------------------------------------------
def test_one_options_object_is_the_keywords(lsq: LeastSquares, tmp_path: Path) -> None:
    from shrinkgrad.sim import RunOptions

    kw: dict[str, object] = dict(rounds=9, log_every=2, tol=1e-30, checkpoint_every=4)
    a = simulate(lsq, "ef21", "top_k[k=2]", 0.01, seed=3, checkpoint=tmp_path / "a.pt", **kw)
    opts = RunOptions(checkpoint=tmp_path / "b.pt", **kw)  # type: ignore[arg-type]
    b = simulate(lsq, "ef21", "top_k[k=2]", 0.01, seed=3, options=opts)
    same_table(a.table, b.table)
    assert (tmp_path / "b.pt").exists()
    assert RunOptions.build(divergence_factor=None).divergence == Divergence.off()
    assert opts.replace(rounds=3).rounds == 3 and opts.rounds == 9
    with pytest.raises(TypeError, match=r"not both \(also given: log_every, rounds\)"):
        simulate(lsq, "gd", None, 0.01, 5, log_every=2, options=opts)
    with pytest.raises(ValueError, match="rounds must be an integer >= 0"):
        opts.replace(rounds=-1)
    with pytest.raises(ValueError, match="wire_dtype must be one of"):
        RunOptions(wire_dtype="int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="callback must be callable"):
        RunOptions(callback=3)  # type: ignore[arg-type]


def test_the_result_prints_in_a_few_lines(lsq: LeastSquares) -> None:
    res = simulate(lsq, "ef21", "top_k[k=2]", "theory", rounds=30, log_every=10)
    text = repr(res)
    lines = text.splitlines()
    assert len(lines) <= 4 and "tensor" not in text
    assert lines[0].startswith("SimResult(completed, 30 rounds, 4 rows: ef21 + top_k[k=2]")
    assert f"stepsize {res.stepsize:.6g} (stepsize_ef21)" in lines[1]
    last = res.table.iloc[-1]
    assert f"round 30: grad_norm_sq={last['grad_norm_sq']:.6g}, loss={last['loss']:.6g}" in text
    with pytest.warns(RuntimeWarning):
        bad = simulate(lsq, "gd", None, 1e3, rounds=30)
    assert repr(bad).startswith("SimResult(diverged") and "diverged at round" in repr(bad)
