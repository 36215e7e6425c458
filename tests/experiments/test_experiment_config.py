"""Config parsing and validation: good files, profiles, overrides, bad files (file, key, reason)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from experiment_configs import SMALL

from shrinkgrad.experiments.config import (
    Arm,
    ConfigError,
    derive_seed,
    dump_config,
    load_config,
    loads_config,
    parse_override,
)
from shrinkgrad.experiments.grid import check_runs, expand


def test_small_config_parses_into_problems_arms_and_seeds(small_config: Path) -> None:
    cfg = load_config(small_config)
    assert cfg.name == "small" and cfg.source == str(small_config)
    assert [p.spec for p in cfg.problems] == [
        "logistic_regression[dataset=a1a,n_clients=4,lam=0.1]",
        "logistic_regression[dataset=australian_scale,n_clients=4,lam=0.1]",
    ]
    assert [p.label for p in cfg.problems] == ["dataset=a1a", "dataset=australian_scale"]
    assert cfg.arms == (
        Arm("ef21", "top_k[k=2]", "theory", "grid"),
        Arm("ef21_w", "top_k[k=2]", "theory", "grid"),
        Arm("dcgd", "rand_k[k=3]", "1/L", "pairs[0]"),
    )
    assert cfg.run.rounds == 12 and cfg.run.log_every == 4 and cfg.run.seeds == (0, 1)
    assert cfg.run.dtype == "float64" and cfg.run.tol is None


def test_names_are_canonicalised_by_the_registries() -> None:
    cfg = loads_config(
        """
        problem = "logistic_regression[ dataset = a1a , n_clients = 3 ]"
        [grid]
        methods = ["ef21_pp[p = 0.5]"]
        compressors = ["top_k[k=1]", "qsgd[s=4]"]
        stepsizes = ["theory", " theory * 2 ", 0.5, "2/L_AM", "theory(ef21)*2"]
        skip_incompatible = true
        """
    )
    assert cfg.problems[0].spec == "logistic_regression[dataset=a1a,n_clients=3]"
    assert {a.method for a in cfg.arms} == {"ef21_pp[p=0.5]"}
    assert [a.stepsize for a in cfg.arms[:5]] == [
        "theory",
        "theory*2",
        "0.5",
        "2/L_AM",
        "theory(ef21)*2",
    ]


def test_sweep_times_cases_and_explicit_labels() -> None:
    cfg = loads_config(
        """
        [problem]
        n_clients = 3
        [problem.sweep]
        lam = [0.1, 0.01]
        [[problem.cases]]
        name = "logistic_regression"
        label = "logreg"
        dataset = "a1a"
        [[problem.cases]]
        name = "least_squares"
        dataset = "a1a"
        [grid]
        methods = ["gd"]
        """
    )
    assert [p.label for p in cfg.problems] == [
        "logreg,lam=0.1",
        "logreg,lam=0.01",
        "dataset=a1a,lam=0.1",
        "dataset=a1a,lam=0.01",
    ]
    assert cfg.problems[2].spec == "least_squares[dataset=a1a,n_clients=3,lam=0.1]"
    assert cfg.problems[1].key == "problem.cases[0]"


def test_a_list_of_problem_specs_is_labelled_by_what_differs() -> None:
    cfg = loads_config(
        """
        problem = ["logistic_regression[dataset=a1a,n_clients=3]",
                   "logistic_regression[dataset=w1a,n_clients=3]"]
        [grid]
        methods = ["gd"]
        """
    )
    assert [p.label for p in cfg.problems] == ["dataset=a1a", "dataset=w1a"]


def test_pairs_can_be_restricted_to_labelled_problems() -> None:
    cfg = loads_config(
        """
        [problem]
        name = "logistic_regression"
        n_clients = 3
        [[problem.cases]]
        label = "A"
        dataset = "a1a"
        [[problem.cases]]
        label = "B"
        dataset = "australian_scale"
        [grid]
        methods = ["gd"]
        [[pairs]]
        problems = ["B"]
        method = "dcgd"
        compressor = "natural"
        """
    )
    runs = expand(cfg)
    assert [(r.problem.label, r.arm.method) for r in runs] == [
        ("A", "gd"),
        ("B", "gd"),
        ("B", "dcgd"),
    ]


def test_profile_and_overrides_are_merged_and_validated(small_config: Path) -> None:
    cfg = load_config(
        small_config, profile="tiny", overrides=["run.seeds=3", 'grid.methods=["ef21"]']
    )
    assert cfg.run.rounds == 6 and cfg.run.seeds == (0, 1, 2) and cfg.profile == "tiny"
    assert [a.method for a in cfg.arms] == ["ef21", "dcgd"]
    cfg = load_config(small_config, overrides={"problem.n_clients": 2, "run.tol_rel": 1e-3})
    assert all("n_clients=2" in p.spec for p in cfg.problems) and cfg.run.tol_rel == 1e-3


def test_override_values_are_toml_or_bare_strings() -> None:
    assert parse_override("run.rounds=50") == ("run.rounds", 50)
    assert parse_override("run.tol=1e-3") == ("run.tol", 1e-3)
    assert parse_override("problem.dataset=w1a") == ("problem.dataset", "w1a")
    assert parse_override('grid.methods=["ef21", "ef"]') == ("grid.methods", ["ef21", "ef"])
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("run.rounds")


def test_the_resolved_config_round_trips(small_config: Path, tmp_path: Path) -> None:
    cfg = load_config(small_config, profile="tiny")
    text = dump_config(cfg)
    again = tmp_path / "resolved.toml"
    again.write_text(text, encoding="utf-8")
    cfg2 = load_config(again)
    assert cfg2.fingerprint == cfg.fingerprint
    assert [r.run_id for r in expand(cfg2)] == [r.run_id for r in expand(cfg)]
    # the profiles travel with the resolved file
    assert load_config(again, profile="tiny").run.rounds == 6


def test_derived_seeds_depend_on_base_and_index_only() -> None:
    assert derive_seed(0, 0) == 0
    seeds = {derive_seed(b, i) for b in range(3) for i in range(4)}
    assert len(seeds) == 12
    assert all(0 <= s < 2**31 for s in seeds)
    assert derive_seed(7, 2) == derive_seed(7, 2)


# --------------------------------------------------------------------------------------------
# bad files: every error names the file, the key and the reason
# --------------------------------------------------------------------------------------------
BAD = [
    ("naem = 'x'\n" + SMALL, "naem", "unknown key.*did you mean 'name'"),
    (SMALL.replace("rounds = 12", "roundz = 12"), "run.roundz", "did you mean 'rounds'"),
    (SMALL.replace("rounds = 12", "rounds = '12'"), "run.rounds", "integer >= 1, got '12'"),
    (SMALL.replace("rounds = 12", "rounds = -1"), "run.rounds", "integer >= 1"),
    (SMALL.replace("seeds = 2", "seeds = [1, 1]"), "run.seeds", "repeated"),
    (SMALL.replace("seeds = 2", "seeds = 'a'"), "run.seeds", "number of seeds"),
    (SMALL.replace("top_k[k=2]", "top_kk[k=2]"), "grid.compressors", "unknown compressor 'top_kk'"),
    (SMALL.replace("top_k[k=2]", "top_k[kk=2]"), "grid.compressors", "no parameter 'kk'"),
    (SMALL.replace('"ef21_w"', '"ef22"'), "grid.methods[1]", "unknown method 'ef22'"),
    (SMALL.replace('stepsize = "1/L"', 'stepsize = "theory*x"'), "pairs[0].stepsize", "step size"),
    (SMALL.replace("lam = 0.1", "lamda = 0.1"), "problem.lamda", "did you mean 'lam'"),
    (SMALL.replace("lam = 0.1", "lam = 'big'"), "problem.lam", "must be a number"),
    (SMALL.replace('"a1a"', '"a1b"'), "problem.sweep.dataset", "unknown dataset 'a1b'.*'a1a'"),
    (
        SMALL.replace('name = "logistic_regression"', 'name = "logistic"'),
        "problem.name",
        "unknown problem 'logistic'",
    ),
    (SMALL.replace("[run]", "[run]\ntol = 1e-3\ntol_rel = 1e-3"), "run.tol_rel", "not both"),
    (
        SMALL.replace("[[pairs]]", "[[pairs]]\nproblems = ['w1a']"),
        "pairs[0].problems[0]",
        "no problem is labelled 'w1a'",
    ),
    (
        SMALL + '\n[[pairs]]\nmethod = "ef21"\ncompressor = "top_k[k=2]"\n',
        "pairs[1]",
        "given twice",
    ),
    ("[grid]\nmethods = ['gd']\n", "problem", "missing"),
    ('problem = "logistic_regression[dataset=a1a]"\n', "grid", "no runs"),
    (SMALL.replace("[run]", "[run"), "", "invalid TOML.*line"),
]


@pytest.mark.parametrize(("text", "key", "reason"), BAD)
def test_bad_configs_name_file_key_and_reason(
    tmp_path: Path, text: str, key: str, reason: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert err.source == str(path) and err.key == key, str(err)
    assert str(err).startswith(f"{path}: ")
    assert key in str(err)
    import re

    assert re.search(reason, err.reason), err.reason


def test_unknown_profile_and_missing_file(small_config: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"profiles.quik: .*no profile 'quik' \(profiles: tiny\)"):
        load_config(small_config, profile="quik")
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "p.toml"
    bad.write_text(SMALL + "\n[profiles.quick]\nrun.roundz = 3\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"profiles.quick.run.roundz: unknown key"):
        load_config(bad, profile="quick")


# --------------------------------------------------------------------------------------------
# impossible combinations: found by binding every pairing before anything runs
# --------------------------------------------------------------------------------------------
def _cfg(body: str) -> str:
    return textwrap.dedent(
        """
        problem = "logistic_regression[dataset=a1a,n_clients=3]"
        [run]
        rounds = 3
        """
    ) + textwrap.dedent(body)


def test_impossible_grid_combination_is_a_config_error() -> None:
    cfg = loads_config(
        _cfg(
            """
            [grid]
            methods = ["dcgd", "ef21"]
            compressors = ["top_k[k=1]", "rand_k[k=2]"]
            """
        ),
        source="grid.toml",
    )
    with pytest.raises(ConfigError) as info:
        check_runs(cfg, expand(cfg))
    assert info.value.key == "grid"
    assert "dcgd · top_k[k=1]" in info.value.reason and "unbiased" in info.value.reason
    assert "skip_incompatible" in info.value.reason


def test_skip_incompatible_skips_only_grid_combinations() -> None:
    cfg = loads_config(
        _cfg(
            """
            [grid]
            methods = ["dcgd", "ef21"]
            compressors = ["top_k[k=1]", "rand_k[k=2]"]
            skip_incompatible = true
            """
        )
    )
    runs, notes, infos = check_runs(cfg, expand(cfg))
    assert {(r.arm.method, r.arm.compressor) for r in runs} == {
        ("dcgd", "rand_k[k=2]"),
        ("ef21", "top_k[k=1]"),
    }
    assert len(notes) == 2 and all(n.startswith("skipped") for n in notes)
    (info,) = infos.values()
    assert info.n == 3 and info.d == 123 and info.L_AM <= info.L_QM


def test_a_pair_without_a_theory_step_is_a_config_error() -> None:
    cfg = loads_config(_cfg('[[pairs]]\nmethod = "ef"\ncompressor = "top_k[k=1]"\n'))
    with pytest.raises(ConfigError) as info:
        check_runs(cfg, expand(cfg))
    assert info.value.key == "pairs[0]" and "no theory step size" in info.value.reason


def test_a_problem_that_cannot_be_built_is_a_config_error() -> None:
    cfg = loads_config(
        """
        [problem]
        name = "logistic_regression"
        dataset = "australian"
        n_clients = 5000
        [grid]
        methods = ["gd"]
        """
    )
    with pytest.raises(ConfigError) as info:
        check_runs(cfg, expand(cfg))
    assert info.value.key == "problem" and "exceeds the 690 samples" in info.value.reason


def test_the_config_step_sizes_are_the_one_grammar_of_bind() -> None:
    """theory(other)*m and c/L resolve in Method.bind (methods/stepsize.py): no copy here."""
    from shrinkgrad.methods import make_method
    from shrinkgrad.problems import make_problem

    p = make_problem("logistic_regression[dataset=a1a,n_clients=3]")
    got = make_method("ef").bind(p, "top_k[k=1]", "theory(ef21)*2").cfg
    ref = make_method("ef21").bind(p, "top_k[k=1]", "theory").cfg
    assert got.stepsize == 2 * ref.stepsize
    assert got.stepsize_rule == "stepsize_ef21*2 of ef21"
    cfg = make_method("gd").bind(p, "identity", "0.5/L_max").cfg
    assert (cfg.stepsize, cfg.stepsize_rule) == (0.5 / p.L_max, "0.5/L_max")
    with pytest.raises(ValueError, match=r"L_min.*L, L_AM, L_QM, L_max"):
        make_method("gd").bind(p, "identity", "1/L_min")
    # the config keeps the canonical spelling (it is part of the run ids)
    cfg2 = loads_config(
        'problem = "logistic_regression[dataset=a1a,n_clients=3]"\n'
        '[grid]\nmethods = ["ef"]\ncompressors = ["top_k[k=1]"]\n'
        'stepsizes = ["theory( ef21 ) * 2", "1 / L", "0.10"]\n'
    )
    assert [a.stepsize for a in cfg2.arms] == ["theory(ef21)*2", "1/L", "0.10"]
    config_source = (Path(shrinkgrad_src()) / "experiments" / "config.py").read_text()
    assert "re.compile" not in config_source  # no second step-size parser


def shrinkgrad_src() -> Path:
    import shrinkgrad

    return Path(shrinkgrad.__file__).parent


def test_the_annotated_example_of_the_docs_is_valid() -> None:
    import re

    doc = (Path(__file__).resolve().parents[2] / "docs" / "experiments.md").read_text()
    example = re.search(r"```toml\n(.*?)```", doc, re.S)
    assert example is not None
    cfg = loads_config(example.group(1), source="docs/experiments.md", profile="quick")
    assert [p.label for p in cfg.problems] == [
        "dataset=w1a,split=contiguous",
        "dataset=w1a,split=heterogeneous_smoothness",
        "aus,split=contiguous",
        "aus,split=heterogeneous_smoothness",
    ]
    runs = expand(cfg)
    assert len(runs) == (4 * 8 + 2 * 1 + 4 * 1) * 3
