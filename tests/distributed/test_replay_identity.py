"""A replay of a parameter-server run (``asynchronous[trace=DIR]``) is of the run's problem.

One tiny run (2 workers, 20 updates, a 40-sample LIBSVM file) is recorded; its schedule
replays on the same problem (the run's iterates), and with another step size or compressor (a
what-if); on another problem with the same number of clients, on other options, or on the same
spec over changed data it used to run silently and is now refused in one line. A trace without a
data digest (saved without the server's snapshot) replays with a warning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shrinkgrad.distributed.ps import PSConfig, run_ps
from shrinkgrad.problems import make_problem
from shrinkgrad.sim import simulate

ROUNDS = 20


def _svm_lines(seed: int = 0) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(40, 5, generator=gen, dtype=torch.float64)
    labels = ["+1" if v > 0 else "-1" for v in torch.randn(40, generator=gen).tolist()]
    return [
        f"{y} " + " ".join(f"{j + 1}:{v:.6f}" for j, v in enumerate(row))
        for y, row in zip(labels, X.tolist(), strict=True)
    ]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The recorded run: its config, result, data file and directory (with its snapshot)."""
    root = tmp_path_factory.mktemp("replay_identity")
    data = root / "mine.svm"
    lines = _svm_lines()
    data.write_text("\n".join(lines) + "\n")
    cfg = PSConfig(
        problem=f"logistic_regression[dataset='{data}']",
        workers=2,
        method="dcgd",
        compressor="rand_k[k=2]",
        stepsize=0.3,
        updates=ROUNDS,
        log_every=1,
        seed=3,
        speeds=(1, 3),
        delay=0.001,
        wire_dtype="float64",
        timeout=30.0,
    )
    out = root / "ps"
    res = run_ps(cfg, out=out)
    res.save(out, plot=False)
    assert res.status == "completed" and res.updates == ROUNDS
    return {"cfg": cfg, "res": res, "data": data, "lines": lines, "out": out, "root": root}


def _replay(problem: Any, out: Path, **kw: Any) -> Any:
    args: dict[str, Any] = {
        "stepsize": 0.3,
        "rounds": ROUNDS,
        "seed": 3,
        "wire_dtype": torch.float64,
        "log_every": 1,
    }
    args.update(kw)
    compressor = args.pop("compressor", "rand_k[k=2]")
    return simulate(problem, f"asynchronous[trace='{out}']", compressor, **args)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_same_problem_replays_the_run_and_what_ifs_still_run(run: dict[str, Any]) -> None:
    cfg, res, out = run["cfg"], run["res"], run["out"]
    same = make_problem(cfg.problem_spec())
    sim = _replay(same, out)
    torch.testing.assert_close(sim.x, res.x, rtol=1e-12, atol=1e-14)
    assert sim.table["round"].tolist() == res.table["round"].tolist()
    # what-ifs on the same asynchrony: another step size, compressor or seed runs, and differs
    half = _replay(same, out, stepsize=0.15)
    assert half.stepsize == 0.15 and not torch.allclose(half.x, res.x)
    assert torch.isfinite(_replay(same, out, compressor="rand_k[k=3]", seed=5).x).all()
    # the parameters may be written in another order, quoted or at their defaults
    spelled = make_problem(f"logistic_regression[n_clients=2,lam=0.1,dataset='{run['data']}']")
    torch.testing.assert_close(_replay(spelled, out).x, res.x, rtol=1e-12, atol=1e-14)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_another_problem_with_the_same_clients_is_refused(run: dict[str, Any]) -> None:
    data, out = run["data"], run["out"]
    lsq = make_problem(f"least_squares[dataset='{data}',n_clients=2]")
    # the same matrix and targets: the data digest alone cannot tell the two problems apart
    assert lsq.data_digest() == make_problem(run["cfg"].problem_spec()).data_digest()
    with pytest.raises(
        ValueError,
        match=r"recorded on the problem logreg_nonconvex, this one is least_squares; replay it "
        r"on the run's problem, make_problem\(",
    ):
        _replay(lsq, out)
    lam = make_problem(f"logistic_regression[dataset='{data}',n_clients=2,lam=0.5]")
    with pytest.raises(ValueError, match=r"lam=0\.5\] \(other options\)"):
        _replay(lam, out)
    # another number of clients is refused as before, naming the workers
    with pytest.raises(ValueError, match="had 2 workers, the problem has n=4 clients"):
        _replay(make_problem(f"logistic_regression[dataset='{data}',n_clients=4]"), out)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_same_spec_on_other_data_is_refused(run: dict[str, Any]) -> None:
    cfg, data, lines, out = run["cfg"], run["data"], run["lines"], run["out"]
    flipped = list(lines)
    flipped[7] = ("-1" if lines[7].startswith("+1") else "+1") + lines[7][2:]
    data.write_text("\n".join(flipped) + "\n")  # one label changed: same spec, n and d
    try:
        other = make_problem(cfg.problem_spec())
    finally:
        data.write_text("\n".join(lines) + "\n")
    assert other.n == 2 and other.d == make_problem(cfg.problem_spec()).d
    with pytest.raises(ValueError, match=r"recorded on other data \(data digest [0-9a-f]{12}"):
        _replay(other, out)
    # the same data under another path (a moved file) is the run's problem
    moved = run["root"] / "moved.svm"
    moved.write_text(data.read_text())
    again = _replay(make_problem(f"logistic_regression[dataset='{moved}',n_clients=2]"), out)
    torch.testing.assert_close(again.x, run["res"].x, rtol=1e-12, atol=1e-14)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_trace_without_a_data_digest_replays_with_a_warning(run: dict[str, Any]) -> None:
    """Saved without the server's snapshot (run_ps without out=, or saved elsewhere), a trace
    records no data digest: the name, data set, d and spec are still checked, the data only
    warned about."""
    cfg, res = run["cfg"], run["res"]
    bare = run["root"] / "bare"
    res.save(bare, plot=False)
    assert not (bare / "checkpoint").exists()
    with pytest.warns(UserWarning, match="records no data digest"):
        sim = _replay(make_problem(cfg.problem_spec()), bare)
    torch.testing.assert_close(sim.x, res.x, rtol=1e-12, atol=1e-14)
    lsq = make_problem(f"least_squares[dataset='{run['data']}',n_clients=2]")
    with pytest.raises(ValueError, match="this one is least_squares"):
        _replay(lsq, bare)
