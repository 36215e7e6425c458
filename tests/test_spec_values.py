"""Spec values beyond names and numbers: keyword arguments, file paths, quantities, lists."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shrinkgrad import make_compressor, make_method, make_problem
from shrinkgrad.problems import make_split
from shrinkgrad.registry import Spec, SpecError, parse_spec

DATA = Path("/work/shared/data/australian_scale")
needs_data = pytest.mark.skipif(not DATA.exists(), reason="shared LIBSVM data not present")


def test_keyword_arguments_build_what_the_spec_builds() -> None:
    kw = make_problem("logistic_regression", dataset="w1a", n_clients=10)
    spec = make_problem("logistic_regression[dataset=w1a,n_clients=10]")
    assert kw.spec == spec.spec == "logistic_regression[dataset=w1a,n_clients=10]"
    assert (kw.n, kw.d, kw.L) == (spec.n, spec.d, spec.L)
    assert make_compressor("qsgd", s=4).spec == make_compressor("qsgd[s=4]").spec
    assert make_method("ef21_pp", p=0.25).spec == "ef21_pp[p=0.25]"
    assert make_split("shuffled", seed=3).spec == make_split("shuffled[seed=3]").spec
    # keywords take precedence over the spec's own parameters, and are type-checked the same way
    assert make_compressor("top_k[k=1]", k=5).spec == "top_k[k=5]"
    with pytest.raises(SpecError, match=r"'k' must be an integer, got 1\.5"):
        make_compressor("top_k", k=1.5)
    with pytest.raises(SpecError, match=r"no parameter 'kk'.*did you mean 'k'"):
        make_compressor("top_k", kk=1)


def test_keywords_on_an_already_built_component_are_refused() -> None:
    C = make_compressor("top_k[k=1]")
    assert make_compressor(C) is C
    with pytest.raises(SpecError, match=r"cannot apply k= to an already built compressor"):
        make_compressor(C, k=2)


@needs_data
def test_a_file_path_needs_no_quotes(tmp_path: Path) -> None:
    plain = tmp_path / "data" / "aus.svm"
    plain.parent.mkdir()
    shutil.copy(DATA, plain)
    p = make_problem(f"logistic_regression[dataset={plain},n_clients=3]")
    assert p.spec == f"logistic_regression[dataset={plain},n_clients=3]"
    assert make_problem(p.spec).d == p.d == 14  # the canonical spec round-trips
    # a Path object as a keyword argument, and relative paths
    assert make_problem("logistic_regression", dataset=plain, n_clients=3).spec == p.spec
    assert parse_spec("x[dataset=./data/aus.svm]").params == (("dataset", "./data/aus.svm"),)
    assert parse_spec("x[dataset=~/aus.svm]").params == (("dataset", "~/aus.svm"),)


@needs_data
def test_a_path_with_spaces_is_quoted_and_the_error_says_so(tmp_path: Path) -> None:
    spaced = tmp_path / "my data" / "aus.svm"
    spaced.parent.mkdir()
    shutil.copy(DATA, spaced)
    with pytest.raises(SpecError) as e:
        make_problem(f"logistic_regression[dataset={spaced},n_clients=3]")
    msg = str(e.value)
    assert "after the value of 'dataset'" in msg and "quote a value with spaces" in msg
    for quoted in (f"'{spaced}'", f'"{spaced}"'):
        p = make_problem(f"logistic_regression[dataset={quoted},n_clients=3]")
        assert p.d == 14
        assert p.spec == f"logistic_regression[dataset='{spaced}',n_clients=3]"
        assert make_problem(p.spec).spec == p.spec


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("x[v=/data/x.svm]", "/data/x.svm"),
        ("x[v=C:\\data\\x.svm]", "C:\\data\\x.svm"),
        ("x[v=tcp://host:8786]", "tcp://host:8786"),
        ("x[v=10mbit]", "10mbit"),
        ("x[v=-1mbit]", "-1mbit"),
        ("x[v=20ms]", "20ms"),
        ("x[v=12.5MB/s]", "12.5MB/s"),
        ("x[v=1e-3]", 1e-3),
        ("x[v=2e3kbit]", "2e3kbit"),
        ("x[v=[1,2.5,a]]", (1, 2.5, "a")),
        ("x[v=[]]", ()),
        ("x[v=[10mbit,[1,2]]]", ("10mbit", (1, 2))),
        (
            "x[v=uniform[low=1mbit,high=2mbit]]",
            Spec("uniform", (("low", "1mbit"), ("high", "2mbit"))),
        ),
        ("x[v='it''s']", None),
    ],
)
def test_values_parse_and_round_trip(text: str, value: object) -> None:
    if value is None:  # two adjacent quoted strings are not one value
        with pytest.raises(SpecError, match="quote a value"):
            parse_spec(text)
        return
    s = parse_spec(text)
    assert s.params == (("v", value),)
    assert parse_spec(str(s)) == s


@pytest.mark.parametrize("value", ["a b", "it's", 'say "hi"', "10", "true", "x,y", "/a b/c"])
def test_strings_that_need_quotes_are_quoted_when_written(value: str) -> None:
    s = Spec("x", (("v", value),))
    assert parse_spec(str(s)).params == (("v", value),)


def test_unexpected_characters_explain_quoting() -> None:
    with pytest.raises(SpecError, match=r"unexpected character ';' at position 12.*quote a value"):
        parse_spec("lr[dataset=a;b]")
    with pytest.raises(SpecError, match=r"after a list item at position 7, found 'b'"):
        parse_spec("x[v=[a b c]]")


def test_a_number_that_overflows_is_refused_and_only_inf_is_infinite() -> None:
    """``star[up=1e400]`` used to parse as an infinitely fast link (float('1e400') is inf)."""
    for text in ("star[up=1e400]", "x[v=-1e400]", "x[v=[1, 2e999]]"):
        with pytest.raises(SpecError, match=r"out of range \(it overflows to infinity\)"):
            parse_spec(text)
    assert parse_spec("x[v=inf]").params == (("v", float("inf")),)
    assert parse_spec("x[v=1e308]").params == (("v", 1e308),)
    from shrinkgrad.network import make_network

    with pytest.raises(ValueError, match="overflows to infinity"):
        make_network("star[up=1e400]")
