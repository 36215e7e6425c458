"""The bad-input corpus: what a new user gets wrong, and the one-line error each mistake must give.

Every case is an input and the error it must produce: for the command line, exit status 2, one
``error:`` line on stderr naming the offending file, key or parameter (and, where there is a
choice, the allowed values), no traceback, and no change to an existing results directory; for
the Python API, the exception type and a message that says the same. Commands run in-process
(click's runner would hide nothing here: ``shrinkgrad.cli.main`` is what the console script
calls); only the distributed launches start processes, and those fail before they start any.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import shrinkgrad as sg
from shrinkgrad.cli import main

#: a small hand-made results table (two rounds of one run)
RESULTS = (
    "round,grad_norm_sq,method,compressor,stepsize_spec,seed_index\n"
    "0,1.0,ef21,top_k,theory,0\n1,0.5,ef21,top_k,theory,0\n"
)

GOOD = """
name = "corpus"
problem = "logistic_regression[dataset=a1a,n_clients=4]"
[run]
rounds = 4
log_every = 2
[grid]
methods = ["ef21"]
compressors = ["top_k[k=2]"]
"""


@dataclasses.dataclass(frozen=True)
class Cli:
    """``shrinkgrad ARGS`` (``{dir}`` is the case's directory) after ``files`` are written."""

    args: str
    match: str
    files: tuple[tuple[str, str | bytes], ...] = ()


@dataclasses.dataclass(frozen=True)
class Api:
    """``call(directory)`` raises ``error`` matching ``match``."""

    call: Callable[[Path], Any]
    error: type[BaseException]
    match: str


def config(replace: str = "", by: str = "", extra: str = "") -> tuple[tuple[str, str], ...]:
    text = GOOD.replace(replace, by) if replace else GOOD
    return (("c.toml", text + extra),)


def svm(name: str, content: str | bytes) -> tuple[tuple[str, str | bytes], ...]:
    return ((name, content),)


def problem(path: str, **kw: Any) -> Callable[[Path], Any]:
    args = ",".join(f"{k}={v}" for k, v in {"n_clients": 2, **kw}.items())
    return lambda d: sg.make_problem(f"logistic_regression[dataset='{d / path}',{args}]")


def with_file(
    name: str, content: str | bytes, call: Callable[[Path], Any]
) -> Callable[[Path], Any]:
    def run(d: Path) -> Any:
        p = d / name
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content, encoding="utf-8")
        return call(d)

    return run


def simulate(**kw: Any) -> Callable[[Path], Any]:
    def run(d: Path) -> Any:
        p = sg.make_problem("logistic_regression[dataset=a1a,n_clients=4]")
        args = {"rounds": 2, **kw}
        return sg.simulate(
            p, args.pop("method", "ef21"), args.pop("compressor", "top_k[k=1]"), **args
        )

    return run


def compress(x: Any, spec: str = "top_k[k=2]") -> Callable[[Path], Any]:
    return lambda d: sg.make_compressor(spec).compress(x, seed=0)


def lsq(**kw: Any) -> Callable[[Path], Any]:
    args = ",".join(f"{k}={v}" for k, v in kw.items())
    return lambda d: sg.make_problem(f"synthetic_least_squares[{args}]")


RUN = "run {dir}/c.toml --out {dir}/out -j 1 --no-progress"
LIB = "logistic_regression[dataset=a1a,n_clients=4]"

CASES: dict[str, Cli | Api] = {
    # ---- malformed LIBSVM files ----------------------------------------------------------------
    "libsvm: bad token": Api(
        with_file("a.svm", "1 1:0.5 x\n-1 2:1\n", problem("a.svm")),
        ValueError,
        r"a\.svm, line 1: token 3 'x' is not of the form index:value",
    ),
    "libsvm: index 0": Api(
        with_file("a.svm", "1 0:1\n-1 2:1\n", problem("a.svm")),
        ValueError,
        r"line 1: .*feature index 0; LIBSVM indices start at 1",
    ),
    "libsvm: non-numeric value": Api(
        with_file("a.svm", "1 1:abc\n-1 2:1\n", problem("a.svm")),
        ValueError,
        r"line 1: .*the value 'abc' is not a number",
    ),
    "libsvm: empty": Api(
        with_file("a.svm", "", problem("a.svm")),
        ValueError,
        r"a\.svm, line 1: the file has no samples",
    ),
    "libsvm: one class": Api(
        with_file("a.svm", "1 1:1\n1 2:1\n", problem("a.svm")),
        ValueError,
        r"all 2 samples have label 1: binary classification needs two classes",
    ),
    "libsvm: huge index": Api(
        with_file("a.svm", "1 99999999999:1\n-1 2:1\n", problem("a.svm")),
        ValueError,
        r"line 1: .*feature index 99999999999 is too large",
    ),
    "libsvm: a CSV": Api(
        with_file("a.csv", "a,b,c\n1,2,3\n", problem("a.csv")), ValueError, r"a\.csv, line 1: "
    ),
    "libsvm: a directory": Api(
        lambda d: sg.make_problem(f"logistic_regression[dataset='{d}']"),
        ValueError,
        r"is a directory; give a LIBSVM file",
    ),
    "libsvm: a missing path": Api(
        problem("missing.svm"),
        ValueError,
        r"unknown dataset .*missing\.svm.*not a bundled name \(.*a9a.*\) and no such file",
    ),
    "libsvm: a binary file": Api(
        with_file("a.bin", bytes(range(256)) * 4, problem("a.bin")), ValueError, r"a\.bin, line 1: "
    ),
    "libsvm: unsorted indices": Api(
        with_file("a.svm", "1 3:1 2:1\n-1 2:1\n", problem("a.svm")),
        ValueError,
        r"line 1: .*feature indices must be increasing",
    ),
    "libsvm: a bad label": Api(
        with_file("a.svm", "yes 1:1\n-1 2:1\n", problem("a.svm")),
        ValueError,
        r"line 1: the label 'yes' is not a number",
    ),
    "libsvm via the CLI": Cli(
        "theory --dataset {dir}/a.svm --clients 2",
        r"a\.svm, line 1: .*index 0",
        svm("a.svm", "1 0:1\n-1 2:1\n"),
    ),
    "theory of a network (L unknown)": Cli(
        "theory --problem mlp[dataset=australian_scale,hidden=2,n_clients=2]",
        r"the smoothness constants L and L_i of mlp\[.*\] are not known .* the command line "
        r"cannot estimate them .* theory_report\(estimate_smoothness\(problem\)\.apply",
    ),
    # ---- config files --------------------------------------------------------------------------
    "config: typo'd key": Cli(
        RUN,
        r"c\.toml: run\.roundz: unknown key; allowed here: .*rounds.*did you mean 'rounds'",
        config("rounds = 4", "roundz = 4"),
    ),
    "config: typo'd top-level key": Cli(
        RUN, r"c\.toml: gird: unknown key; allowed here: .*grid", config("[grid]", "[gird]")
    ),
    "config: wrong type": Cli(
        RUN,
        r"c\.toml: run\.rounds: must be an integer >= 1, got 'four'",
        config("rounds = 4", 'rounds = "four"'),
    ),
    "config: float rounds": Cli(
        RUN, r"run\.rounds: must be an integer >= 1, got 4\.5", config("rounds = 4", "rounds = 4.5")
    ),
    "config: negative rounds": Cli(
        RUN, r"run\.rounds: must be an integer >= 1, got -5", config("rounds = 4", "rounds = -5")
    ),
    "config: zero rounds": Cli(
        RUN, r"run\.rounds: must be an integer >= 1, got 0", config("rounds = 4", "rounds = 0")
    ),
    "config: unknown method": Cli(
        RUN, r"grid\.methods: unknown method 'ef22'; known: .*ef21", config('["ef21"]', '["ef22"]')
    ),
    "config: unknown compressor": Cli(
        RUN,
        r"grid\.compressors: unknown compressor 'top-k'; known: .*top_k",
        config('"top_k[k=2]"', '"top-k"'),
    ),
    "config: unknown compressor parameter": Cli(
        RUN, r"compressor 'top_k' has no parameter 'kk'", config("k=2", "kk=2")
    ),
    "config: k > d": Cli(
        RUN, r"grid: .*k=500.*d=123|k = 500 .*d = 123|k=500.*123", config("k=2", "k=500")
    ),
    "config: theroy": Cli(
        RUN,
        r"grid\.stepsizes: cannot read the step size 'theroy'.*'theory'",
        config(extra='stepsizes = ["theroy"]\n'),
    ),
    "config: seeds = 0": Cli(
        RUN,
        r"run\.seeds: must be >= 1 \(the number of seeds\), got 0",
        config("log_every = 2", "log_every = 2\nseeds = 0"),
    ),
    "config: seeds negative list": Cli(
        RUN,
        r"run\.seeds: must be the number of seeds .* or a non-empty list",
        config("log_every = 2", "log_every = 2\nseeds = [-1]"),
    ),
    "config: impossible method/compressor pair": Cli(
        RUN,
        r"c\.toml: grid: dcgd · top_k\[k=2\].*needs an unbiased compressor.*skip_incompatible",
        config('["ef21"]', '["dcgd"]'),
    ),
    "config: more clients than samples": Cli(
        RUN,
        r"c\.toml: problem: cannot build .*n_clients=5000.*690",
        config(
            '"logistic_regression[dataset=a1a,n_clients=4]"',
            '"logistic_regression[dataset=australian,n_clients=5000]"',
        ),
    ),
    "config: unknown dataset": Cli(
        RUN,
        r"unknown dataset 'a1b'.*bundled name \(.*a1a.*did you mean 'a1a'",
        config("dataset=a1a", "dataset=a1b"),
    ),
    "config: unknown problem": Cli(
        RUN,
        r"unknown problem 'logistic'; known: .*logistic_regression",
        config("logistic_regression[", "logistic["),
    ),
    "config: invalid TOML": Cli(RUN, r"c\.toml: invalid TOML", (("c.toml", "name = \n"),)),
    "config: missing problem": Cli(
        RUN, r"c\.toml: problem: missing: say which problem", (("c.toml", GOOD.split("\n", 3)[3]),)
    ),
    "config: no arms": Cli(
        RUN, r"c\.toml: grid: no runs: give a \[grid\]", (("c.toml", GOOD.split("[grid]")[0]),)
    ),
    "config: tol and tol_rel": Cli(
        RUN,
        r"run\.tol_rel: give tol \(absolute\) or tol_rel, not both",
        config("log_every = 2", "log_every = 2\ntol = 1e-3\ntol_rel = 1e-3"),
    ),
    "config: bad dtype": Cli(
        RUN,
        r"run\.dtype: must be one of float32, float64, got 'float16'",
        config("log_every = 2", 'log_every = 2\ndtype = "float16"'),
    ),
    "config: bad divergence_factor": Cli(
        RUN,
        r"run\.divergence_factor: must be a number > 1 or false",
        config("log_every = 2", "log_every = 2\ndivergence_factor = 0.5"),
    ),
    "config: a name with a path separator": Cli(
        RUN, r"c\.toml: name: 'a/b' contains '/'", config('name = "corpus"', 'name = "a/b"')
    ),
    "config: unknown profile": Cli(
        RUN + " --profile fast", r"this config has no profile 'fast' \(profiles: none\)", config()
    ),
    "config: bad --set": Cli(
        RUN + " --set rounds", r"--set: rounds: write an override as KEY=VALUE", config()
    ),
    "config: missing file": Cli("run {dir}/nope.toml", r"nope\.toml: no such config file"),
    "config: a directory": Cli(
        "run {dir}",
        r"CONFIG.*is a directory",
    ),
    "config: theory for a method without a rule": Cli(
        RUN, r"grid: ef · top_k\[k=2\].*(no|has no) .*(rule|theory)", config('["ef21"]', '["ef"]')
    ),
    "config: bad step-size constant": Cli(
        RUN,
        r"cannot read the step size '1/L_min': 'L_min' is not a constant.*L, L_AM, L_QM, L_max",
        config(extra='stepsizes = ["1/L_min"]\n'),
    ),
    "config: --out is a file": Cli(
        "run {dir}/c.toml --out {dir}/c.toml",
        r"'--out'.*c\.toml' is a file.*shrinkgrad run --help",
        config(),
    ),
    "config: unknown executor": Cli(
        RUN + " --executor dusk", r"unknown executor 'dusk'; known: dask, local", config()
    ),
    "config: bad executor parameter": Cli(
        RUN + " --executor local[jobz=2]", r"executor 'local' has no parameter 'jobz'", config()
    ),
    # ---- the API -------------------------------------------------------------------------------
    "api: rounds = 0 is allowed, negative is not": Api(
        simulate(rounds=-1), ValueError, r"rounds must be an integer >= 0, got -1"
    ),
    "api: rounds not an integer": Api(
        simulate(rounds=2.5), ValueError, r"rounds must be an integer >= 0, got 2\.5"
    ),
    "api: a wrong x0 shape": Api(simulate(x0=torch.zeros(5)), ValueError, r"x0.*123|123.*x0"),
    "api: NaN data": Api(
        lambda d: (
            sg.compress(torch.tensor([1.0, float("nan")]), "top_k[k=1]")
            if hasattr(sg, "compress")
            else sg.make_compressor("top_k[k=1]").compress(
                torch.tensor([1.0, float("nan")]), seed=0
            )
        ),
        ValueError,
        r"(nan|NaN|finite)",
    ),
    "api: float16 input where unsupported": Api(
        lambda d: sg.make_problem("logistic_regression[dataset=a1a,n_clients=2,dtype=float16]"),
        (ValueError, TypeError),
        r"dtype",
    ),  # type: ignore[arg-type]
    "api: a 0-d tensor": Api(
        compress(torch.tensor(1.0)),
        (ValueError, TypeError),
        r"(0-d|scalar|dimension|shape|at least one)",
    ),  # type: ignore[arg-type]
    "api: an empty tensor": Api(
        compress(torch.zeros(0)), (ValueError, TypeError), r"(empty|d=0|size|at least one|k=2)"
    ),  # type: ignore[arg-type]
    "api: unknown method": Api(
        simulate(method="ef22"), ValueError, r"unknown method 'ef22'; known: .*ef21"
    ),
    "api: an impossible pair": Api(
        simulate(method="dcgd", compressor="top_k[k=1]"),
        ValueError,
        r"dcgd needs an unbiased compressor",
    ),
    "api: a bad step size": Api(
        simulate(stepsize="theroy"), ValueError, r"cannot read the step size 'theroy'.*'theory'"
    ),
    "api: a negative step size": Api(
        simulate(stepsize=-0.1), ValueError, r"step size must be a finite number > 0"
    ),
    "api: a negative seed": Api(
        simulate(seed=-1), ValueError, r"seed must be a non-negative integer"
    ),
    "api: log_every = 0": Api(
        simulate(log_every=0), ValueError, r"log_every must be an integer >= 1"
    ),
    "api: unknown compressor parameter": Api(
        lambda d: sg.make_compressor("top_k[kk=1]"),
        ValueError,
        r"compressor 'top_k' has no parameter 'kk'; allowed: k",
    ),
    "api: unknown problem parameter": Api(
        lambda d: sg.make_problem("logistic_regression[dataset=a1a,n_client=2]"),
        ValueError,
        r"no parameter 'n_client'.*did you mean 'n_clients'",
    ),
    "api: synthetic d = 0": Api(lsq(n_clients=2, d=0), ValueError, r"\bd\b"),
    "api: load_results of a missing directory": Api(
        lambda d: __import__("shrinkgrad.experiments", fromlist=["load_results"]).load_results(
            d / "none"
        ),
        FileNotFoundError,
        r"no such results directory",
    ),
    # ---- distributed launches ------------------------------------------------------------------
    "train: more ranks than clients": Cli(
        "train {dir}/c.toml --out {dir}/out --nproc 6",
        r"--nproc 6: .*n=4 clients.*--nproc <= 4",
        config(),
    ),
    "train: nproc 0": Cli(
        "train {dir}/c.toml --out {dir}/out --nproc 0",
        r"'--nproc'.*0 is not in the range x>=1",
        config(),
    ),
    "ps: a bad --speeds": Cli("ps --workers 2 --speeds 1,x --out {dir}/out", r"--speeds"),
    "ps: --workers 0": Cli(
        "ps --workers 0 --out {dir}/out",
        r"workers \(the number of worker processes\) must be an integer >= 1, got 0",
    ),
    "ps: tau_max below W - 1": Cli("ps --workers 4 --tau-max 1 --out {dir}/out", r"tau.max|τ"),
    # ---- plots ---------------------------------------------------------------------------------
    "plot: a missing directory": Cli("plot {dir}/none", r"no such results directory"),
    "plot: an empty directory": Cli(
        "plot {dir}/empty",
        r"empty.* holds no results .*shrinkgrad run CONFIG --out DIR",
        (("empty/.keep", ""),),
    ),
    "plot: a corrupt results file": Cli(
        "plot {dir}/res",
        r"res/results\.parquet: cannot read it",
        (("res/results.parquet", b"PAR1 not really"),),
    ),
    "plot: a hand-edited results table": Cli(
        "plot {dir}/res --y loss",
        r"the results table has no column 'bits_up'; use one of rounds$",  # the axes it has
        (("res/results.csv", "round,grad_norm_sq\n0,1.0\n"),),
    ),
    "plot: an unknown --facet": Cli(
        "plot {dir}/res --x rounds --facet colour",
        r"cannot facet by 'colour': .* use none or one of round, grad_norm_sq, method",
        (("res/results.csv", RESULTS),),
    ),
    "plot: --where an unknown column": Cli(
        "plot {dir}/res --x rounds --where colour=red",
        r"--where 'colour=red': the results have no column 'colour'; columns: round, grad",
        (("res/results.csv", RESULTS),),
    ),
    "plot: --where a value no row has": Cli(
        "plot {dir}/res --x rounds --where method=ef2",
        r"no rows have method = 'ef2'; its values: ef21$",
        (("res/results.csv", RESULTS),),
    ),
    "plot: --out below a file": Cli(
        "plot {dir}/res --x rounds -o {dir}/blocker/fig",
        r"cannot write the figure .*blocker' is a file, not a directory; choose another --out",
        (("res/results.csv", RESULTS), ("blocker", "")),
    ),
    # ---- networks ------------------------------------------------------------------------------
    "estimate: a negative bandwidth": Cli(
        "estimate --problem least_squares --network star[up=-1mbit]",
        r"star parameter 'up' must be > 0, got '-1mbit'; give a bandwidth such as 10mbit",
    ),
    "estimate: an unknown unit": Cli(
        "estimate --problem least_squares --network ring[bandwidth=1gbat]",
        r"ring parameter 'bandwidth': cannot read '1gbat'; give a bandwidth such as",
    ),
    "estimate: a bandwidth list of the wrong length": Cli(
        "estimate --problem logistic_regression[dataset=australian_scale,n_clients=5] "
        "--network star[up=[1mbit,2mbit]]",
        r"star parameter 'up': a list of 2 values for 5 clients; give one value per client",
    ),
    "API: a path with spaces in a spec, unquoted": Api(
        lambda d: sg.make_problem(f"logistic_regression[dataset={d}/my data/x.svm,n_clients=3]"),
        ValueError,
        r"after the value of 'dataset'.*quote a value with spaces",
    ),
}


def _write(directory: Path, files: tuple[tuple[str, str | bytes], ...]) -> None:
    for name, content in files:
        p = directory / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content, encoding="utf-8")


def _state(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_the_corpus_is_large_enough() -> None:
    assert len(CASES) >= 60
    assert sum(isinstance(c, Cli) for c in CASES.values()) >= 30


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_input_gives_its_one_line_error(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    case = CASES[name]
    if isinstance(case, Api):
        with pytest.raises(case.error) as info:
            case.call(tmp_path)
        assert re.search(case.match, str(info.value)), str(info.value)
        assert "\n" not in str(info.value).strip()
        return
    _write(tmp_path, case.files)
    # an existing results directory next to the inputs must not change
    before = _state(tmp_path)
    args = [a.replace("{dir}", str(tmp_path)) for a in case.args.split()]
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.strip().splitlines() if not ln.startswith("note: ")]
    assert code == 2, captured.err + captured.out
    assert "Traceback" not in captured.err + captured.out
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert re.search(case.match, lines[0]), lines[0]
    after = _state(tmp_path)
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    assert {k for k in changed if not k.startswith("out/")} == set(), changed
