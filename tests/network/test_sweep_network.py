"""``[run] network`` in a sweep config: an axis of networks, the time_model_s column, the plot."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shrinkgrad.experiments.config import ConfigError, loads_config
from shrinkgrad.experiments.grid import check_runs, expand
from shrinkgrad.experiments.runner import run_experiment
from shrinkgrad.sim import simulate

BASE = """
name = "net"
[problem]
name = "synthetic_least_squares"
n_clients = 4
d = 10
[run]
rounds = 6
log_every = 2
{run}
[grid]
methods = ["ef21"]
compressors = ["top_k[k=2]", "identity"]
"""

NETS = ["star[up=1mbit,compute=0]", "star[up=100mbit,compute=0]"]


def config(run: str):  # type: ignore[no-untyped-def]
    return loads_config(BASE.format(run=run), source="net.toml")


def test_a_list_of_networks_is_an_axis_with_its_own_runs() -> None:
    plain = expand(config(""))
    runs = expand(config(f"network = {NETS!r}".replace("'", '"')))
    assert len(runs) == 2 * len(plain)
    assert {r.network for r in runs} == set(NETS)
    assert len({r.run_id for r in runs}) == len(runs)
    # runs without a network keep their ids (and configs their fingerprints)
    assert {r.run_id for r in plain} == {r.run_id for r in expand(config(""))}
    assert all(r.network is None for r in plain)


def test_the_sweep_tables_equal_simulate_with_the_network(tmp_path: Path) -> None:
    cfg = config(f"network = {NETS!r}".replace("'", '"'))
    res = run_experiment(cfg, tmp_path / "out", jobs=1, progress=False)
    assert res.complete
    t = res.table
    assert set(t["network"]) == set(NETS)
    for (net, comp), df in t.groupby(["network", "compressor"]):
        ref = simulate(
            "synthetic_least_squares[n_clients=4,d=10]",
            "ef21",
            comp,
            rounds=6,
            log_every=2,
            network=net,
        )
        np.testing.assert_allclose(df["time_model_s"], ref.table["time_model_s"], rtol=1e-12)
    # runs.csv says which network each run was modelled on, and its final modelled time
    runs = res.runs.set_index("run_id")
    for run_id, df in t.groupby("run_id"):
        row = runs.loc[run_id]
        assert row["network"] == df["network"].iloc[0]
        assert row["time_model_s"] == df["time_model_s"].iloc[-1]
    # the slower network takes longer for the same traffic
    slow = t[t["network"] == NETS[0]].groupby("compressor")["time_model_s"].max()
    fast = t[t["network"] == NETS[1]].groupby("compressor")["time_model_s"].max()
    assert (slow > fast).all()


def test_plot_draws_one_curve_per_network(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from shrinkgrad.plotting.curves import aggregate

    cfg = config(f"network = {NETS!r}".replace("'", '"'))
    res = run_experiment(cfg, tmp_path / "out", jobs=1, progress=False)
    curves = aggregate(res.table, x="time_model", y="grad_norm_sq")
    assert set(curves["network"]) == set(NETS)
    assert len(curves.groupby(["compressor", "network"])) == 4


@pytest.mark.parametrize(
    ("run", "words"),
    [
        ('network = "star[up=-1mbit]"', ["run.network", "'up'", "must be > 0"]),
        ('network = "star[up=10mbat]"', ["run.network", "cannot read '10mbat'"]),
        ("network = 3", ["run.network", "must be a network spec"]),
        ('network = ["star[up=1mbit]", "star[up=1mbit]"]', ["run.network", "repeated"]),
    ],
)
def test_config_mistakes_are_one_line_errors(run: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        config(run)
    msg = str(info.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_a_bandwidth_list_of_the_wrong_length_is_caught_before_running() -> None:
    cfg = config('network = "star[up=[1mbit,2mbit,3mbit]]"')
    with pytest.raises(ConfigError) as info:
        check_runs(cfg, expand(cfg))
    msg = str(info.value)
    assert "\n" not in msg
    assert "run.network" in msg and "a list of 3 values for 4 clients" in msg


def test_a_distributed_sweep_refuses_a_modelled_network() -> None:
    pytest.importorskip("torch.distributed")
    from shrinkgrad.experiments.distributed_sweep import plan

    with pytest.raises(ConfigError, match=r"run\.network"):
        plan(config('network = "star[up=1mbit]"'))
