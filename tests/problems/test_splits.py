"""Client splits: partitions, the authors' chunking, keyed randomness, skew, and errors."""

from __future__ import annotations

import numpy as np
import pytest

from shrinkgrad.problems import SPLITS, ExplicitSplit, load, make_split, resolve_split
from shrinkgrad.problems.datasets import Dataset
from shrinkgrad.registry import SpecError

PARTITIONS = ["contiguous", "shuffled[seed=3]", "by_label", "dirichlet[alpha=0.5,seed=1]",
              "heterogeneous_smoothness"]  # fmt: skip


@pytest.mark.parametrize("spec", PARTITIONS)
@pytest.mark.parametrize("n", [1, 7, 100])
def test_every_split_is_a_partition_into_nonempty_clients(spec: str, n: int) -> None:
    ds = load("australian")
    parts = make_split(spec)(ds, n)
    assert len(parts) == n and all(p.size > 0 and p.dtype == np.int64 for p in parts)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(ds.n_samples))


def test_contiguous_is_the_ef21_authors_chunking() -> None:
    # generate_data.py of the EF21 code: m = N // n rows each, the last worker takes the rest
    ds = load("a9a")
    parts = make_split("contiguous")(ds, 1000)
    m = 32561 // 1000
    for i in (0, 1, 998):
        np.testing.assert_array_equal(parts[i], np.arange(i * m, (i + 1) * m))
    np.testing.assert_array_equal(parts[-1], np.arange(999 * m, 32561))
    assert parts[-1].size == 32 + 561


def test_shuffled_is_keyed_deterministic_and_seed_dependent() -> None:
    ds = load("w1a")
    a = make_split("shuffled[seed=5]")(ds, 10)
    b = make_split("shuffled[seed=5]")(ds, 10)
    c = make_split("shuffled[seed=6]")(ds, 10)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0], c[0])
    # chunk sizes are those of the contiguous split
    assert [p.size for p in a] == [p.size for p in make_split("contiguous")(ds, 10)]


def test_by_label_gives_single_class_clients() -> None:
    ds = load("mushrooms")
    parts = make_split("by_label")(ds, 8)
    mixed = [i for i, p in enumerate(parts) if np.unique(ds.y[p]).size > 1]
    assert len(mixed) <= 1
    assert np.all(ds.y[parts[0]] == -1) and np.all(ds.y[parts[-1]] == 1)


def _label_entropy(ds: Dataset, parts: list[np.ndarray]) -> float:
    ent = []
    for p in parts:
        q = float((ds.y[p] > 0).mean())
        ent.append(0.0 if q in (0.0, 1.0) else -(q * np.log(q) + (1 - q) * np.log(1 - q)))
    return float(np.mean(ent))


def test_dirichlet_concentration_controls_label_skew() -> None:
    ds = load("mushrooms")
    skewed = make_split("dirichlet[alpha=0.05,seed=0]")(ds, 20)
    mild = make_split("dirichlet[alpha=100,seed=0]")(ds, 20)
    # near-iid clients have label entropy close to the global one, skewed ones much less
    q = float((ds.y > 0).mean())
    global_entropy = -(q * np.log(q) + (1 - q) * np.log(1 - q))
    assert _label_entropy(ds, mild) > 0.95 * global_entropy
    assert _label_entropy(ds, skewed) < 0.5 * global_entropy


def test_dirichlet_fills_empty_clients() -> None:
    ds = load("australian")
    parts = make_split("dirichlet[alpha=0.01,seed=2]")(ds, 300)
    assert min(p.size for p in parts) == 1


def test_heterogeneous_smoothness_norm_key_sorts_by_row_norm() -> None:
    ds = load("a1a")
    parts = make_split("heterogeneous_smoothness[key=norm]")(ds, 5)
    norms = np.asarray(ds.X.multiply(ds.X).sum(axis=1)).ravel()
    means = [norms[p].mean() for p in parts]
    assert means == sorted(means)
    assert norms[parts[0]].max() <= norms[parts[1]].min()


@pytest.mark.parametrize("name", ["a1a", "australian_scale"])
def test_heterogeneous_smoothness_spreads_the_L_i(name: str) -> None:
    from shrinkgrad.problems import logistic_regression

    var = {
        s: logistic_regression(name, n_clients=20, split=s).L_var
        for s in ("contiguous", "shuffled[seed=0]", "heterogeneous_smoothness")
    }
    assert var["heterogeneous_smoothness"] > 10 * max(var["contiguous"], var["shuffled[seed=0]"])


def test_too_many_clients_is_an_error_unless_reuse_is_explicit() -> None:
    ds = load("australian")
    with pytest.raises(ValueError, match=r"n_clients=1000 exceeds the 690 samples .*reuse=true"):
        make_split("contiguous")(ds, 1000)
    parts = make_split("contiguous[reuse=true]")(ds, 1000)
    assert len(parts) == 1000 and all(p.size == 1 for p in parts)
    assert parts[690][0] == 0 and parts[999][0] == 999 - 690


def test_explicit_split_validation() -> None:
    ds = load("australian")
    parts, name = resolve_split([np.arange(3), [5, 6]], ds, None)
    assert name == "explicit[n_clients=2]" and [p.tolist() for p in parts] == [[0, 1, 2], [5, 6]]
    with pytest.raises(ValueError, match="client 1 has no samples"):
        ExplicitSplit([[0], []])(ds)
    with pytest.raises(ValueError, match=r"client 0's indices must be in \[0, 690\)"):
        ExplicitSplit([[690]])(ds)
    with pytest.raises(TypeError, match="booleans"):
        ExplicitSplit([np.array([True, False])])
    with pytest.raises(ValueError, match="n_clients=3 but the explicit split has 2"):
        resolve_split([[0], [1]], ds, 3)
    with pytest.raises(ValueError, match="n_clients is required"):
        resolve_split("contiguous", ds, None)


def test_split_registry_names_and_parameter_errors() -> None:
    assert SPLITS.names() == sorted(
        ["by_label", "contiguous", "dirichlet", "heterogeneous_smoothness", "shuffled"]
    )
    assert make_split("dirichlet[alpha=0.3,seed=4]").spec == "dirichlet[alpha=0.3,seed=4]"
    with pytest.raises(SpecError, match="no parameter 'alpa'"):
        make_split("dirichlet[alpa=0.3]")
    with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
        make_split("dirichlet[alpha=0]")
    with pytest.raises(ValueError, match="positive integer"):
        make_split("contiguous")(load("australian"), 0)
