"""Grid expansion: counts, order, stable run ids, seeds derived per axis."""

from __future__ import annotations

from pathlib import Path

from shrinkgrad.experiments.config import derive_seed, load_config
from shrinkgrad.experiments.grid import expand


def test_expand_is_problems_times_arms_times_seeds_in_order(small_config: Path) -> None:
    cfg = load_config(small_config)
    runs = expand(cfg)
    assert len(runs) == 2 * 3 * 2
    order = [(r.problem.label, r.arm.method, r.seed_index) for r in runs]
    expected = [
        (p, m, s)
        for p in ("dataset=a1a", "dataset=australian_scale")
        for m in ("ef21", "ef21_w", "dcgd")
        for s in (0, 1)
    ]
    assert order == expected
    assert len({r.run_id for r in runs}) == len(runs)
    assert all(r.seed == derive_seed(cfg.run.seed, r.seed_index) for r in runs)


def test_run_ids_and_seeds_do_not_depend_on_the_rest_of_the_grid(small_config: Path) -> None:
    base = {
        r.identity()["method"] + str(r.seed_index) + r.problem.label: r
        for r in expand(load_config(small_config))
    }
    more = load_config(
        small_config,
        overrides={
            "grid.methods": ["ef", "ef21", "ef21_w"],
            "grid.stepsizes": ["theory(ef21)", "theory"],
        },
    )
    # ef at "theory(ef21)" is new; ef21/ef21_w at "theory" keep their ids and seeds
    bigger = {
        r.identity()["method"] + str(r.seed_index) + r.problem.label: r
        for r in expand(more)
        if r.arm.stepsize == "theory" or r.arm.method == "dcgd"
    }
    for key, run in base.items():
        assert bigger[key].run_id == run.run_id
        assert bigger[key].seed == run.seed


def test_run_ids_change_with_anything_that_changes_the_result(small_config: Path) -> None:
    ids = {r.run_id for r in expand(load_config(small_config))}
    for override in (
        "run.rounds=13",
        "run.log_every=3",
        "run.seed=1",
        "run.tol=1e-9",
        "run.dtype=float32",
    ):
        changed = {r.run_id for r in expand(load_config(small_config, overrides=[override]))}
        assert not ids & changed, override
    # but not with the checkpoint interval, which leaves the result unchanged
    same = {
        r.run_id for r in expand(load_config(small_config, overrides=["run.checkpoint_every=2"]))
    }
    assert same == ids


def test_seed_indices_select_the_same_seeds(small_config: Path) -> None:
    two = expand(load_config(small_config))
    picked = expand(load_config(small_config, overrides={"run.seeds": [1]}))
    assert {r.run_id for r in picked} == {r.run_id for r in two if r.seed_index == 1}
