"""Independent references for the quantizers and the non-sparse transforms (audit of
``quantize.py``, ``basic.py``, ``transforms.py``).

Every reference below is written from the operator's *definition* (docs/compressors.md,
methods.md §2) in float64 Python arithmetic, without the library's own helpers
(``linf_worst_case``, ``Ternary.omega_of``, ``l2_norms``, ...):

* the law of C(x): each coordinate independently takes one of two neighbouring levels, the
  upper one with the probability that makes it unbiased; for ``scaled``/``compose`` the law is
  enumerated outcome by outcome (C2 applied to every outcome of C1), so E[C(x)] and
  E‖C(x) − x‖² are exact;
* the declared constants: ω(d) (α(d)) must bound the exact E‖C(x) − x‖² on adversarial inputs
  (one-hot, all-equal, geometric, two-level, random) and, where the docs say "exact" or
  "tight", a dense scan must reach it;
* the keyed draws: a batched call with N client keys must sample the exact law (support of
  every coordinate, the frequency of its upper level within 6 binomial standard errors, the
  spread of the number of coordinates rounded up as for independent coordinates, and
  E‖C(x) − x‖² within 6 standard errors);
* the bits: ``bits``/``paper_bits`` equal the documented formulas for float32, float64 and
  bfloat16, and ``encode`` gives exactly ⌈bits/8⌉ bytes that decode to C(x) bit for bit.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np
import pytest
import torch

from shrinkgrad import Keys, make_compressor

Law = list[tuple[float, float, float]]  # per coordinate: (lower value, upper value, P(upper))
Outcomes = list[tuple[float, np.ndarray]]  # (probability, vector)


# --------------------------------------------------------------------------------------------
# references from the definitions
# --------------------------------------------------------------------------------------------
def _sign(v: float) -> float:
    return -1.0 if math.copysign(1.0, v) < 0 else 1.0


def _grid_law(x: np.ndarray, scale: float, grid: list[float]) -> Law:
    """Unbiased rounding of u_j = |x_j|/scale (clamped to 1) to the grid, times sign·scale."""
    law: Law = []
    for v in x:
        u = min(abs(v) / scale, 1.0) if scale > 0 else 0.0
        sg = _sign(v) * scale
        for p, q in itertools.pairwise(grid):
            if u == q:
                law.append((sg * q, sg * q, 0.0))
                break
            if p <= u < q:
                law.append((sg * p, sg * q, (u - p) / (q - p)))
                break
    return law


def _norm(x: np.ndarray, norm: float) -> float:
    return float(np.sqrt((x * x).sum())) if norm == 2 else float(np.abs(x).max())


def ref_law(spec: str, x: np.ndarray) -> Law:
    """The per-coordinate law of the quantizers (and Bernoulli), from their definitions."""
    if spec == "ternary":  # TernGrad: ‖x‖_∞ · sign · Bernoulli(|x_j|/‖x‖_∞)
        return _grid_law(x, _norm(x, math.inf), [0.0, 1.0])
    if spec.startswith(("qsgd", "standard_dithering")):  # levels {0, 1/s, …, 1} of ‖x‖
        s = int(spec.split("s=")[1].split(",")[0].rstrip("]"))
        norm = math.inf if "norm=inf" in spec else 2
        return _grid_law(x, _norm(x, norm), [j / s for j in range(s + 1)])
    if spec.startswith("natural_dithering"):  # levels {0, 2^{1−s}, …, 1/2, 1} of ‖x‖
        s = int(spec.split("s=")[1].split(",")[0].rstrip("]"))
        norm = math.inf if "norm=inf" in spec else 2
        return _grid_law(x, _norm(x, norm), [0.0] + [2.0 ** (1 - s + e) for e in range(s)])
    if spec == "natural":  # |x_j| ∈ [2^e, 2^{e+1}) to 2^e or 2^{e+1}
        law: Law = []
        for v in x:
            if v == 0:
                law.append((0.0, 0.0, 0.0))
                continue
            _, e = math.frexp(abs(v))  # |v| = m·2^e, m ∈ [1/2, 1)
            lo = math.ldexp(1.0, e - 1)
            law.append((_sign(v) * lo, _sign(v) * 2 * lo, abs(v) / lo - 1.0))
        return law
    if spec.startswith("bernoulli"):
        p = float(spec.split("p=")[1].rstrip("]"))
        return [(0.0, v / p, p) for v in x]
    raise KeyError(spec)


def outcomes_of(law: Law) -> Outcomes:
    """Every outcome of independent coordinates with its probability."""
    res: Outcomes = []
    for ups in itertools.product((False, True), repeat=len(law)):
        prob = 1.0
        for up, (_, _, p) in zip(ups, law, strict=True):
            prob *= p if up else 1.0 - p
        if prob > 0:
            vals = [hi if up else lo for up, (lo, hi, _) in zip(ups, law, strict=True)]
            res.append((prob, np.array(vals)))
    return res


def _top_k_idx(x: np.ndarray, k: int) -> list[int]:
    """The k largest |x_j|, ties to the lower index."""
    return sorted(sorted(range(x.size), key=lambda j: (-abs(x[j]), j))[:k])


def ref_outcomes(spec: str, x: np.ndarray) -> Outcomes:
    """The full law of C(x) by enumeration: quantizers, top_k, scaled_sign, scaled, compose."""
    d = x.size
    if spec.startswith("scaled(") and spec.endswith(")"):  # C/(1 + ω_C)
        inner = spec[len("scaled(") : -1]
        c = 1.0 / (1.0 + make_compressor(inner).omega(d))
        return [(p, c * v) for p, v in ref_outcomes(inner, x)]
    if spec.startswith("compose(") and spec.endswith(")"):
        first, second = _split_args(spec[len("compose(") : -1])
        res: Outcomes = []
        if first.startswith("top_k"):  # sparse mode: C2 on the k kept values
            idx = _top_k_idx(x, int(first.split("=")[1].rstrip("]")))
            for q, z in ref_outcomes(second, x[idx]):
                v = np.zeros(d)
                v[idx] = z
                res.append((q, v))
            return res
        for p, y in ref_outcomes(first, x):  # dense mode: C2 on C1(x), independent draws
            res += [(p * q, z) for q, z in ref_outcomes(second, y)]
        return res
    if spec.startswith("top_k"):
        v = np.zeros(d)
        idx = _top_k_idx(x, int(spec.split("=")[1].rstrip("]")))
        v[idx] = x[idx]
        return [(1.0, v)]
    if spec == "scaled_sign":  # (‖x‖₁/d)·sign(x), +0 → +
        m = float(np.abs(x).sum()) / d
        return [(1.0, np.array([_sign(v) * m for v in x]))]
    return outcomes_of(ref_law(spec, x))


def _split_args(s: str) -> tuple[str, str]:
    depth = 0
    for i, ch in enumerate(s):
        depth += ch in "[("
        depth -= ch in "])"
        if ch == "," and depth == 0:
            return s[:i], s[i + 1 :]
    raise ValueError(s)


def exact_moments(spec: str, x: np.ndarray) -> tuple[np.ndarray, float]:
    """(E[C(x)], E‖C(x) − x‖²) of the enumerated law."""
    outs = ref_outcomes(spec, x)
    assert sum(p for p, _ in outs) == pytest.approx(1.0, abs=1e-12)
    mean = sum((p * v for p, v in outs), np.zeros(x.size))
    err = sum(p * float(((v - x) ** 2).sum()) for p, v in outs)
    return mean, err


# --------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------
def adversarial(d: int, seed: int = 0) -> list[np.ndarray]:
    """One-hot, all-equal (with signs), geometric, linear, two-level families around the ℓ∞
    worst cases, natural's tight binade points, and heavy-tailed random vectors."""
    rng = np.random.default_rng(seed)
    xs = [np.eye(d)[0] * 3.0, np.ones(d), np.where(np.arange(d) % 2, -1.0, 1.0)]
    xs += [r ** np.arange(d) for r in (0.1, 0.5, 0.9)]
    xs.append(np.arange(1.0, d + 1.0))
    for t in np.linspace(0.05, 0.95, 10):
        for k in {1, max(1, d // 2)}:
            v = np.full(d, t)
            v[:k] = 1.0
            xs.append(v)
    xs.append(np.array([4 / 3 * 2.0**e for e in range(-(d // 2), d - d // 2)]))
    xs += [rng.standard_normal(d) * np.exp(2 * rng.standard_normal(d)) for _ in range(12)]
    return xs


QUANTIZERS = [
    "qsgd[s=1]",
    "qsgd[s=3]",
    "standard_dithering[s=2,norm=2]",
    "standard_dithering[s=3,norm=inf]",
    "ternary",
    "natural",
    "natural_dithering[s=1]",
    "natural_dithering[s=3]",
    "natural_dithering[s=2,norm=inf]",
    "natural_dithering[s=4,norm=inf]",
    "bernoulli[p=0.3]",
]


# --------------------------------------------------------------------------------------------
# 1. the exact law: unbiased, and ω(d) bounds it on adversarial inputs
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", QUANTIZERS)
@pytest.mark.parametrize("d", [1, 2, 5, 8])
def test_exact_law_is_unbiased_and_within_omega(spec: str, d: int) -> None:
    c = make_compressor(spec)
    omega = c.omega(d)
    for x in adversarial(d, seed=d):
        mean, err = exact_moments(spec, x)
        assert np.allclose(mean, x, rtol=1e-12, atol=1e-14 * np.abs(x).max()), (spec, x)
        assert err <= omega * float((x * x).sum()) * (1 + 1e-12), (spec, x, err, omega)


def _scan_two_level(spec: str, d: int, n: int = 4001) -> float:
    """max over t of E‖C(x) − x‖²/‖x‖² on x = (1, t, …, t): the ℓ∞ worst-case family."""
    best = 0.0
    for t in np.linspace(0.0, 1.0, n):
        x = np.full(d, t)
        x[0] = 1.0
        _, err = exact_moments(spec, x)
        best = max(best, err / float((x * x).sum()))
    return best


@pytest.mark.parametrize(
    "spec", ["ternary", "standard_dithering[s=3,norm=inf]", "natural_dithering[s=3,norm=inf]"]
)
@pytest.mark.parametrize("d", [2, 5])
def test_exact_linf_omega_is_reached_by_a_scan(spec: str, d: int) -> None:
    """docs: the ℓ∞ constants are exact worst cases, attained on (1, t, …, t): a 4001-point
    scan of that family, computed from the definition, comes within 1e-5 of ω(d) (and the
    previous test shows nothing exceeds it)."""
    omega = make_compressor(spec).omega(d)
    best = _scan_two_level(spec, d)
    assert best <= omega * (1 + 1e-12)
    assert best >= omega * (1 - 1e-5), (best, omega)


def test_tight_constants_are_attained_exactly() -> None:
    """natural: ω = 1/8 at |x_j| = (4/3)·2^e; ternary: (√d − 1)/2 at t = 1/(√d + 1);
    scaled(C) then attains α = 1/(1 + ω) exactly; scaled_sign: α = 1/d at a spike."""
    x = np.array([4 / 3 * 2.0**e for e in range(-3, 3)])
    _, err = exact_moments("natural", x)
    assert err / float((x * x).sum()) == pytest.approx(make_compressor("natural").omega(6), 1e-12)
    _, err = exact_moments("scaled(natural)", x)
    alpha = make_compressor("scaled(natural)").alpha(6)
    assert err / float((x * x).sum()) == pytest.approx(1 - alpha, rel=1e-12)
    for d in (2, 5, 9):
        t = np.full(d, 1 / (math.sqrt(d) + 1))
        t[0] = 1.0
        _, err = exact_moments("ternary", t)
        assert err / float((t * t).sum()) == pytest.approx(make_compressor("ternary").omega(d))
        _, err = exact_moments("scaled(ternary)", t)
        alpha = make_compressor("scaled(ternary)").alpha(d)
        assert err / float((t * t).sum()) == pytest.approx(1 - alpha, rel=1e-12)
        spike = np.zeros(d)
        spike[d - 1] = -2.5
        _, err = exact_moments("scaled_sign", spike)
        assert err / 6.25 == pytest.approx(1 - make_compressor("scaled_sign").alpha(d), 1e-12)


# --------------------------------------------------------------------------------------------
# 2. contractive forms: α(d) bounds the exact law of scaled(C), compose(...), scaled_sign
# --------------------------------------------------------------------------------------------
TRANSFORMS = [
    "scaled_sign",
    "scaled(qsgd[s=2])",
    "scaled(natural)",
    "scaled(ternary)",
    "scaled(natural_dithering[s=2])",
    "scaled(standard_dithering[s=3,norm=inf])",
    "compose(natural,qsgd[s=8])",  # unbiased ∘ unbiased
    "compose(ternary,natural)",
    "compose(natural,top_k[k=4])",  # unbiased, then contractive (Minkowski)
    "compose(scaled(natural),qsgd[s=16])",  # contractive, then unbiased
    "compose(scaled(natural),top_k[k=4])",  # contractive ∘ contractive
    "compose(top_k[k=3],qsgd[s=4])",  # projection, then unbiased on the k values
    "compose(top_k[k=3],scaled(qsgd[s=1]))",
    "compose(top_k[k=3],scaled_sign)",
    "compose(top_k[k=4],ternary)",
]


@pytest.mark.parametrize("spec", TRANSFORMS)
def test_transforms_exact_law_within_their_constant(spec: str) -> None:
    d = 5
    c = make_compressor(spec)
    for x in adversarial(d, seed=11)[::2]:
        mean, err = exact_moments(spec, x)
        n2 = float((x * x).sum())
        if c.kind == "unbiased":
            assert np.allclose(mean, x, rtol=1e-12, atol=1e-14 * np.abs(x).max()), (spec, x)
            assert err <= c.omega(d) * n2 * (1 + 1e-12), (spec, x)
        else:
            assert err <= (1 - c.alpha(d)) * n2 * (1 + 1e-12), (spec, x, err / n2, c.alpha(d))


def test_compose_constants_from_the_documented_rules() -> None:
    """The rules of docs/compressors.md, from the parts' constants (written out here)."""
    d = 20
    w_nat, a_top = 1 / 8, 16 / 20
    w_q8 = min(d / 64, math.sqrt(d) / 8)
    cases = {
        "compose(natural,qsgd[s=8])": 1 / ((1 + w_nat) * (1 + w_q8)),
        "compose(natural,top_k[k=16])": 1
        - (math.sqrt((1 - a_top) * (1 + w_nat)) + math.sqrt(w_nat)) ** 2,
        "compose(scaled(natural),qsgd[s=8])": 8 / 9 - w_q8 * (1 + math.sqrt(1 - 8 / 9)) ** 2,
        "compose(scaled(natural),top_k[k=16])": 1
        - (math.sqrt(1 - a_top) * (1 + math.sqrt(1 / 9)) + math.sqrt(1 / 9)) ** 2,
        "compose(top_k[k=4],qsgd[s=4])": 4 / 20 * (1 - min(4 / 16, 2 / 4)),
        "compose(top_k[k=4],scaled_sign)": 4 / 20 * (1 / 4),
        "scaled(qsgd[s=2])": 1 / (1 + min(20 / 4, math.sqrt(20) / 2)),
    }
    for spec, alpha in cases.items():
        assert make_compressor(spec).alpha(d) == pytest.approx(alpha, rel=1e-14), spec


# --------------------------------------------------------------------------------------------
# 3. the keyed draws sample the exact law
# --------------------------------------------------------------------------------------------
N_MC = 4000


def _draws(spec: str, x: np.ndarray, dtype: torch.dtype, seed: int) -> np.ndarray:
    c = make_compressor(spec)
    xt = torch.tensor(x, dtype=torch.float64).to(dtype).expand(N_MC, -1).contiguous()
    keys = Keys.derive(seed, round=2, client=np.arange(N_MC))
    return c(xt, keys).to(torch.float64).numpy()


def _mc_inputs(d: int) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    two = np.full(d, 0.3)
    two[0] = -1.0
    return [
        np.ones(d),
        0.7 ** np.arange(d),
        two,
        rng.standard_normal(d) * np.exp(rng.standard_normal(d)),
    ]


@pytest.mark.parametrize("spec", QUANTIZERS)
def test_draws_sample_the_exact_law(spec: str) -> None:
    d = 6
    for i, x in enumerate(_mc_inputs(d)):
        law = ref_law(spec, x)
        y = _draws(spec, x, torch.float64, seed=100 + i)
        ups = np.zeros_like(y)
        var_sum = 0.0
        for j, (lo, hi, p) in enumerate(law):
            col = y[:, j]
            tol = 1e-12 * max(abs(lo), abs(hi))
            at_lo, at_hi = np.abs(col - lo) <= tol, np.abs(col - hi) <= tol
            assert bool((at_lo | at_hi).all()), (spec, x, j, np.unique(col), lo, hi)
            if lo == hi:
                continue
            freq = float(at_hi.mean())
            assert abs(freq - p) <= 6 * math.sqrt(p * (1 - p) / N_MC) + 1 / N_MC, (spec, j)
            ups[:, j] = at_hi - p
            var_sum += p * (1 - p)
        # independent coordinates: Var(number rounded up) = Σ p_j(1 − p_j), to 6 s.e.
        if var_sum > 0.05:
            v = float(ups.sum(1).var())
            assert abs(v - var_sum) <= 6 * var_sum * math.sqrt(2 / N_MC) + 0.02, (spec, v, var_sum)
        _, exact = exact_moments(spec, x)
        err = ((y - x) ** 2).sum(1)
        assert abs(float(err.mean()) - exact) <= 6 * float(err.std()) / math.sqrt(N_MC) + 1e-12


@pytest.mark.parametrize("spec", ["qsgd[s=3]", "ternary", "natural", "natural_dithering[s=3]"])
def test_float32_draws_match_the_exact_variance(spec: str) -> None:
    d = 6
    for i, x in enumerate(_mc_inputs(d)):
        x = x.astype(np.float32).astype(np.float64)  # the float32 input, exactly
        y = _draws(spec, x, torch.float32, seed=200 + i)
        _, exact = exact_moments(spec, x)
        err = ((y - x) ** 2).sum(1)
        tol = 6 * float(err.std()) / math.sqrt(N_MC) + 1e-6 * float((x * x).sum())
        assert abs(float(err.mean()) - exact) <= tol, (spec, x)


@pytest.mark.parametrize(
    "spec",
    [
        "scaled(ternary)",
        "compose(natural,qsgd[s=4])",
        "compose(scaled(natural),top_k[k=3])",
        "compose(top_k[k=3],qsgd[s=2])",
        "compose(top_k[k=4],ternary)",
    ],
)
def test_transform_draws_match_the_exact_law(spec: str) -> None:
    d = 5
    for i, x in enumerate(_mc_inputs(d)):
        outs = ref_outcomes(spec, x)
        mean = sum((p * v for p, v in outs), np.zeros(d))
        sd = np.sqrt(np.maximum(sum((p * v * v for p, v in outs), np.zeros(d)) - mean**2, 0))
        y = _draws(spec, x, torch.float64, seed=300 + i)
        assert bool((np.abs(y.mean(0) - mean) <= 6 * sd / math.sqrt(N_MC) + 1e-12).all())
        _, exact = exact_moments(spec, x)
        err = ((y - x) ** 2).sum(1)
        assert abs(float(err.mean()) - exact) <= 6 * float(err.std()) / math.sqrt(N_MC) + 1e-12


# --------------------------------------------------------------------------------------------
# 4. bits and the wire
# --------------------------------------------------------------------------------------------
def _lg(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def _documented_bits(spec: str, d: int, dtype: torch.dtype) -> tuple[float, float]:
    """(bits, paper_bits) as docs/compressors.md states them: per-message scalars in the
    dtype's width (float32 for 16-bit inputs), values in the dtype's width; the papers count
    32 per scalar and 32 (16 on a 16-bit wire) per value."""
    scalar = 64 if dtype == torch.float64 else 32
    value = torch.finfo(dtype).bits
    paper_value = 16 if value == 16 else 32
    if spec.startswith(("qsgd", "standard_dithering", "natural_dithering")):
        s = int(spec.split("s=")[1].split(",")[0].rstrip("]"))
        return scalar + d * (1 + _lg(s + 1)), 32 + d * (1 + _lg(s + 1))
    fixed: dict[str, Callable[[], tuple[float, float]]] = {
        "ternary": lambda: (scalar + 2 * d, 32 + 2 * d),
        "natural": lambda: ((12 if dtype == torch.float64 else 9) * d, 9 * d),
        "scaled_sign": lambda: (scalar + d, 32 + d),
        "identity": lambda: (value * d, paper_value * d),
        "scaled(qsgd[s=2])": lambda: (scalar + 3 * d, 32 + 3 * d),
        "compose(natural,qsgd[s=4])": lambda: (scalar + 4 * d, 32 + 4 * d),
    }
    return fixed[spec]()


WIRE_SPECS = [
    "qsgd[s=1]",
    "qsgd[s=3]",
    "qsgd[s=4]",
    "qsgd[s=255]",
    "standard_dithering[s=7,norm=inf]",
    "standard_dithering[s=8,norm=inf]",
    "ternary",
    "natural",
    "natural_dithering[s=1]",
    "natural_dithering[s=3]",
    "natural_dithering[s=8,norm=inf]",
    "scaled_sign",
    "identity",
    "scaled(qsgd[s=2])",
    "compose(natural,qsgd[s=4])",
]


def _patterns(t: torch.Tensor) -> torch.Tensor:
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}
    return t.view(ints.get(t.dtype, torch.int16))


@pytest.mark.parametrize("spec", WIRE_SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_bits_are_the_documented_formulas_and_the_wire_size(spec: str, dtype: torch.dtype) -> None:
    c = make_compressor(spec)
    for d in (1, 7, 64, 65):
        bits, paper = _documented_bits(spec, d, dtype)
        assert c.bits(d, dtype) == bits, (spec, d, dtype)
        assert c.paper_bits(d, dtype) == paper, (spec, d, dtype)
        g = torch.Generator().manual_seed(d)
        x = torch.randn(d, generator=g, dtype=torch.float64).to(dtype)
        if d > 2:
            x[1], x[2] = 0.0, -0.0
        keys = Keys.derive(3, round=1, client=d)
        payload = c.encode(x, keys)
        assert payload.dtype == torch.uint8 and payload.numel() == math.ceil(bits / 8)
        got = c.decode(payload, d, dtype, keys)
        assert torch.equal(_patterns(got), _patterns(c(x, keys))), (spec, d, dtype)
