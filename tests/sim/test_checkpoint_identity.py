"""A checkpoint resumes only the problem it was written for (stop 35's audit).

Two problems with the same name, data set, n, d and x⁰ can be different problems: another client
split, held-out fraction, loss or regulariser. Each pair below is checked to agree on all of
those before the resume is asked to refuse, so the refusal can only come from what tells the two
problems apart; a problem written differently but the same resumes bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from shrinkgrad.problems import Problem, make_problem, model_problem
from shrinkgrad.sim import SimulationInterrupted, load_checkpoint, save_checkpoint, simulate

MLP = "mlp[dataset=australian_scale,n_clients=4,hidden=5"
LOGREG = "logistic_regression[dataset=australian_scale,n_clients=4"
ARGS = dict(method="ef21", compressor="top_k[k=3]", stepsize=0.3)

PAIRS = [
    (MLP + ",split=contiguous]", MLP + ",split=by_label]", "split"),
    (MLP + ",split=dirichlet[seed=0]]", MLP + ",split=dirichlet[seed=2]]", "split"),
    (MLP + "]", MLP + ",test=0.5]", "n_test"),
    ("net:logistic", "net:mse", "loss"),
    (LOGREG + ",split=contiguous]", LOGREG + ",split=by_label]", "split"),
    (LOGREG + "]", LOGREG + ",lam=0.2]", "lam"),
]


def _problem(name: str) -> Problem:
    """A registry spec, or ``net:<loss>``: one user network (no spec) with the loss given."""
    if not name.startswith("net:"):
        return make_problem(name)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(14, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    # no held-out part: the two losses' held-out columns differ, and would tell them apart
    loss = name.removeprefix("net:")
    return model_problem(net, "australian_scale", n_clients=4, loss=loss, test=0)


def _run(problem: str | Problem, path: Path | None = None, **kw: object):  # type: ignore[no-untyped-def]
    args = {**ARGS, "rounds": 3, **kw}
    return simulate(problem, checkpoint=path, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(("a", "b", "what"), PAIRS)
def test_a_checkpoint_of_another_problem_variant_is_refused(
    a: str, b: str, what: str, tmp_path: Path
) -> None:
    pa, pb = _problem(a), _problem(b)
    # what the fingerprint held before: the same name, data set, n, d and x⁰
    for key in ("problem", "dataset", "n_clients", "d"):
        assert pa.info()[key] == pb.info()[key]
    assert torch.equal(pa.x0(), pb.x0())
    # and yet they are different problems: another loss at x⁰, or another split
    assert pa.info() != pb.info()
    path = tmp_path / "run.pt"
    _run(pa, path)
    with pytest.raises(ValueError, match=rf"belongs to a different run \(.*problem\.{what}: ") as e:
        _run(pb, path, rounds=5)
    assert "\n" not in str(e.value) and "another checkpoint path" in str(e.value)
    # the problem it was written for resumes it
    assert _run(_problem(a), path, rounds=5).rounds == 5


def test_the_same_problem_written_differently_resumes_bit_for_bit(tmp_path: Path) -> None:
    short = MLP + "]"
    # defaults written out, and parameters that say how (not what) to compute
    spelled = MLP + ",split=contiguous,test=0.2,seed=0,loss=cross_entropy,device=cpu,threads=1]"
    spelled = spelled.replace(",threads=1", "")  # mlp has no threads parameter
    full = _run(short, rounds=6)

    def stop(r: int, state: object) -> None:
        if r == 3:
            raise KeyboardInterrupt

    path = tmp_path / "run.pt"
    with pytest.raises(SimulationInterrupted):
        _run(short, path, rounds=6, callback=stop)
    resumed = _run(spelled, path, rounds=6)
    cols = [c for c in full.table.columns if c != "time_s"]
    pd.testing.assert_frame_equal(resumed.table[cols], full.table[cols], check_exact=True)
    assert torch.equal(resumed.x, full.x)


def test_a_checkpoint_that_does_not_identify_its_problem_is_refused(tmp_path: Path) -> None:
    """A checkpoint of an earlier version (no problem.* entries in its fingerprint)."""
    path = tmp_path / "old.pt"
    _run(MLP + "]", path)
    saved = load_checkpoint(path)
    assert saved is not None
    assert saved["fingerprint"]["problem.split"] == "contiguous"
    old = {k: v for k, v in saved["fingerprint"].items() if not k.startswith("problem.")}
    save_checkpoint(path, {**saved, "fingerprint": old})
    with pytest.raises(ValueError, match=r"earlier version .* split.*delete it") as e:
        _run(MLP + "]", path, rounds=5)
    assert "\n" not in str(e.value)
