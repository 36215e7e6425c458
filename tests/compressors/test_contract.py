"""The shared contract of every registered compressor (parametrized over the registry).

Shape and dtype kept, finite output, determinism per key, batched == per-client, zero in → zero
out, bad input rejected, wire round trip with the declared size, ``out=`` and the torch / numba
paths agreeing bit for bit; the same for 16-bit inputs; the sparse form equal to the dense one;
constant functions refusing a nonsensical d; the convenience form needing a seed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from compressor_examples import ALL, EXAMPLES, D
from hypothesis import given
from hypothesis import strategies as st

from shrinkgrad import COMPRESSORS, Compressor, Keys, make_compressor
from shrinkgrad.compressors import base

DTYPES = [torch.float32, torch.float64]
HALF = [torch.bfloat16, torch.float16]


def _x(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _keys(n: int | None, seed: int = 7) -> Keys:
    return Keys.derive(seed, round=3, client=0 if n is None else np.arange(n))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so that comparisons distinguish -0.0 and +0.0."""
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}
    return t.view(ints.get(t.dtype, torch.int16))


def test_every_compressor_has_examples() -> None:
    # A newly registered compressor must be added to compressor_examples.EXAMPLES.
    assert set(COMPRESSORS.names()) == set(EXAMPLES)
    for name, specs in EXAMPLES.items():
        assert specs, name
        for spec in specs:
            assert make_compressor(spec).spec.startswith(name)


@pytest.mark.parametrize("spec", ALL)
def test_canonical_name_round_trips(spec: str) -> None:
    c = make_compressor(spec)
    again = make_compressor(c.spec)
    assert again.spec == c.spec
    assert type(again) is type(c)


@pytest.mark.parametrize("spec", ALL)
@pytest.mark.parametrize("dtype", DTYPES + HALF)
@pytest.mark.parametrize("shape", [(D,), (3, D), (2, 3, D)])
def test_shape_dtype_finite_and_per_key_determinism(
    spec: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    c = make_compressor(spec)
    if dtype not in c.dtypes():
        with pytest.raises(TypeError, match="compresses float32"):
            c(_x(shape, dtype), _keys(None))
        return
    x = _x(shape, dtype)
    keys = Keys.derive(5, round=1, client=np.arange(math.prod(shape[:-1])).reshape(shape[:-1]))
    y = c(x, keys)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert bool(torch.isfinite(y).all())
    assert torch.equal(_bits(c(x.clone(), keys)), _bits(y))  # same key, same draw
    if not c.deterministic and len(shape) == 2:
        other = c(x, Keys.derive(6, round=1, client=np.arange(shape[0])))
        assert not torch.equal(other, y)  # a different seed draws differently


@pytest.mark.parametrize("spec", ALL)
@pytest.mark.parametrize("dtype", DTYPES + HALF)
def test_batched_equals_per_client(spec: str, dtype: torch.dtype) -> None:
    c = make_compressor(spec)
    if dtype not in c.dtypes():
        return
    n = 4
    x = _x((n, D), dtype, seed=1)
    if getattr(c, "collective_rows", False):
        # a collective compressor (power_sgd[shared=true]): the rows of a call are the clients
        # of one collective, each row's result depends on the others' (tests/compressors/
        # test_lowrank.py checks the collective); rows equal to one vector give its result
        same = x[:1].expand(n, D).clone()
        batched = c(same, Keys.derive(11, round=2, client=np.arange(n)))
        for i in range(n):
            assert torch.equal(
                _bits(c(x[0], Keys.derive(11, round=2, client=i))), _bits(batched[i])
            )
        return
    batched = c(x, Keys.derive(11, round=2, client=np.arange(n)))
    for i in range(n):
        single = c(x[i], Keys.derive(11, round=2, client=i))
        assert torch.equal(_bits(single), _bits(batched[i]))
        via_compress = c.compress(x[i], 11, round=2, client=i)
        assert torch.equal(_bits(via_compress), _bits(single))
    assert torch.equal(c.compress(x, 11, round=2, client=torch.arange(n)), batched)


@pytest.mark.parametrize("spec", ALL)
@pytest.mark.parametrize("dtype", DTYPES + HALF)
def test_zero_vector_compresses_to_zero(spec: str, dtype: torch.dtype) -> None:
    c = make_compressor(spec)
    if dtype not in c.dtypes():
        return
    x = torch.zeros(2, D, dtype=dtype)
    y = c(x, _keys(2))
    assert bool((y == 0).all())


@pytest.mark.parametrize("spec", ALL)
@pytest.mark.parametrize("kernels", ["numba", "torch"])
def test_an_empty_batch_gives_an_empty_batch(
    spec: str, kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of 0 clients (0, D) on both kernel paths (the torch path's gather of rand_k and
    strat_k used to fail to reshape 0 rows)."""
    monkeypatch.setattr(base, "KERNELS", kernels)
    c = make_compressor(spec)
    y = c(torch.zeros(0, D), _keys(0))
    assert y.shape == (0, D)


@pytest.mark.parametrize("spec", ALL)
def test_bad_inputs_are_rejected(spec: str) -> None:
    c = make_compressor(spec)
    x = _x((2, D), torch.float64)
    for bad in (math.inf, -math.inf, math.nan):
        xb = x.clone()
        xb[1, 7] = bad
        with pytest.raises(ValueError, match="non-finite"):
            c(xb, _keys(2))
    with pytest.raises(TypeError, match=r"compresses float32, float64.* tensors, got torch.int64"):
        c(x.to(torch.int64), _keys(2))
    with pytest.raises(TypeError, match="torch tensors"):
        c(x.numpy(), _keys(2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="last axis"):
        c(torch.zeros(2, 0), _keys(2))
    if not c.deterministic:
        with pytest.raises(ValueError, match="needs keys"):
            c(x)
        with pytest.raises(ValueError, match="do not match"):
            c(x, _keys(3))


@pytest.mark.parametrize("spec", ALL)
@pytest.mark.parametrize("dtype", DTYPES + HALF)
def test_wire_round_trip_and_size(spec: str, dtype: torch.dtype) -> None:
    """decode(encode(x)) == C(x) bit for bit, in exactly ⌈bits(d, dtype)/8⌉ bytes; 16-bit
    inputs send their values in 16 bits (and so fewer bytes than float32 whenever values are
    sent, the same when only codes and a float32 norm are)."""
    c = make_compressor(spec)
    if dtype not in c.dtypes():
        return
    for seed in range(3):
        x = _x((D,), dtype, seed=seed)
        if seed == 2:
            x[::3] = 0.0  # zeros change nothing in the format, except for Bernoulli's count
        keys = _keys(None, seed=seed)
        y = c(x, keys)
        payload = c.encode(x, keys)
        assert payload.dtype == torch.uint8 and payload.ndim == 1
        assert torch.equal(_bits(c.decode(payload, D, dtype, keys)), _bits(y))
        nbits = float(c.message_bits(y[None])[0])
        assert payload.numel() == math.ceil(nbits / 8)
        if not c.variable_size:
            assert nbits == c.bits(D, dtype)
            assert payload.numel() == math.ceil(c.bits(D, dtype) / 8)
    if dtype in HALF:
        assert c.bits(D, dtype) <= c.bits(D, torch.float32)
        assert c.paper_bits(D, dtype) <= c.paper_bits(D, torch.float32)


@pytest.mark.parametrize("spec", ALL)
def test_out_argument(spec: str) -> None:
    c = make_compressor(spec)
    x = _x((3, D), torch.float32, seed=4)
    keys = _keys(3)
    ref = c(x, keys)
    buf = torch.full_like(x, 123.0)
    assert c(x, keys, out=buf) is buf
    assert torch.equal(_bits(buf), _bits(ref))
    strided = torch.full((D, 3), 5.0).t()  # a non-contiguous out
    c(x, keys, out=strided)
    assert torch.equal(_bits(strided), _bits(ref))
    with pytest.raises(ValueError, match="out must match"):
        c(x, keys, out=torch.empty(3, D + 1))
    with pytest.raises(ValueError, match="not be the input"):
        c(x, keys, out=x)


@pytest.mark.parametrize("spec", ALL)
def test_declared_constants_are_consistent(spec: str) -> None:
    c = make_compressor(spec)
    assert c.kind in ("unbiased", "contractive")
    assert c.collective in ("allreduce", "allgather", "allreduce_factors")
    if not c.constant_known:  # power_sgd without alpha=: the unknown constant is a state
        from shrinkgrad.compressors import ConstantUnknownError

        with pytest.raises(ConstantUnknownError, match="no worst-case"):
            c.alpha(D)
        assert 0 < c.paper_bits(D) <= c.bits(D, torch.float32) < c.bits(D, torch.float64)
        return
    a = c.alpha(D)
    assert 0.0 < a <= 1.0
    if c.kind == "unbiased":
        w = c.omega(D)
        assert w >= 0.0 and a == pytest.approx(1.0 / (1.0 + w), rel=1e-15)
    else:
        with pytest.raises(TypeError, match="no ω"):
            c.omega(D)
    assert 0 < c.paper_bits(D) <= c.bits(D, torch.float32) < c.bits(D, torch.float64) + 1e-9


@pytest.mark.parametrize("spec", ALL)
@pytest.mark.parametrize("dtype", DTYPES)
def test_numba_path_equals_torch_path(
    spec: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same keys, same output, bit for bit. Exception, stated: QSGD, natural dithering and
    scaled sign sum (squared) entries in a different order on the two paths, so in float64
    their row norms (and hence outputs) agree only to round-off; given the same norm the
    kernels agree bit for bit (test_operators.py), and in float32 the norm rounded up to
    float32 agrees exactly here."""
    c = make_compressor(spec)
    x = _x((3, 2 * D + 5), dtype, seed=8)
    x[1, ::4] = 0.0
    x[2, 3] = -0.0
    keys = _keys(3, seed=9)
    monkeypatch.setattr(base, "KERNELS", "torch")
    ref = c(x, keys)
    monkeypatch.setattr(base, "KERNELS", "numba")
    fast = c(x, keys)
    norm_based = any(n in spec for n in ("qsgd", "scaled_sign")) or (
        "dithering" in spec and "norm=inf" not in spec
    )
    if dtype == torch.float64 and norm_based:
        torch.testing.assert_close(fast, ref, rtol=1e-14, atol=0.0)
    else:
        assert torch.equal(_bits(fast), _bits(ref))


@pytest.mark.parametrize("spec", ALL)
@pytest.mark.parametrize("bad", [-3, 0, 2.5, True, "20", None])
def test_constant_functions_say_what_is_wrong_with_d(spec: str, bad: object) -> None:
    """alpha(-3), bits(0), omega(2.5), ...: a one-line error naming d and what it must be."""
    c = make_compressor(spec)
    fns = ["alpha", "bits", "paper_bits", "index_bits", "sparse_k"]
    fns += ["omega"] if c.kind == "unbiased" else []
    for fn in fns:
        err = TypeError if not isinstance(bad, int) or isinstance(bad, bool) else ValueError
        with pytest.raises(err, match=r"\(d\): d is the vector length, a positive integer; got"):
            getattr(c, fn)(bad)


@pytest.mark.parametrize("spec", ALL)
def test_convenience_form_needs_a_seed_and_draws_per_row(spec: str) -> None:
    """12.4: C.compress(x) without a seed refuses for random compressors (a fixed default gave
    the same "random" draw on every call); the rows of a batch are clients 0, 1, … by
    default, each its own draw — exactly C(x, Keys.derive(seed, client=arange(n)))."""
    c = make_compressor(spec)
    x = _x((1, D), torch.float64, seed=2).expand(8, D).clone()  # equal rows: only keys differ
    if c.deterministic:
        assert torch.equal(c.compress(x), c(x))
        return
    with pytest.raises(ValueError, match=r"is random: compress\(x, seed=\.\.\.\) needs a seed"):
        c.compress(x)
    y = c.compress(x, seed=3)
    assert torch.equal(_bits(y), _bits(c(x, Keys.derive(3, client=np.arange(8)))))
    assert any(not torch.equal(y[0], y[i]) for i in range(1, 8)), "one shared draw per batch"
    assert torch.equal(_bits(c.compress(x[0], seed=3)), _bits(y[0]))  # a vector is client 0
    assert torch.equal(c.compress(x, seed=3, client=7), c(x, Keys.derive(3, client=7)))


@pytest.mark.parametrize("spec", [s for s in ALL if make_compressor(s).sparse_message])
@pytest.mark.parametrize("dtype", DTYPES + HALF)
def test_sparse_form_equals_the_dense_form(spec: str, dtype: torch.dtype) -> None:
    """C.sparse(x, keys) scattered into zeros is C(x, keys) bit for bit (batches for the
    fixed-size sparsifiers, one vector for random-size messages); distinct int64 indices."""
    c = make_compressor(spec)
    x = _x((3, D), dtype, seed=5)
    x[1, ::4] = 0.0
    x[2, 3] = -0.0
    keys = _keys(3, seed=6)
    dense = c(x, keys)
    rows = [(x, keys, dense)] if c.sparse_batches else []
    rows += [(x[i], keys[i], dense[i]) for i in range(3)]
    for xi, ki, want in rows:
        idx, vals = c.sparse(xi, ki)
        assert idx.dtype == torch.int64 and vals.dtype == dtype
        assert idx.shape == vals.shape and idx.shape[:-1] == xi.shape[:-1]
        flat = idx.reshape(-1, idx.shape[-1])
        assert all(row.unique().numel() == row.numel() for row in flat)
        got = torch.zeros_like(xi).scatter_(-1, idx, vals)
        assert torch.equal(_bits(got), _bits(want))
    if not c.sparse_batches:
        with pytest.raises(ValueError, match=r"one\s+vector"):
            c.sparse(x, keys)


@pytest.mark.parametrize("spec", [s for s in ALL if make_compressor(s).sparse_message])
@pytest.mark.parametrize("dtype", [*DTYPES, None])
def test_sparse_difference_is_the_sparse_form_of_the_difference(
    spec: str, dtype: torch.dtype | None
) -> None:
    """C.sparse_difference(a, b, keys, dtype=t) is C.sparse((a − b).to(t), keys) bit for bit
    (t = None: a − b itself; float32 a, b rounded to bfloat16 and float16 for ``None``)."""
    c = make_compressor(spec)
    wdtype = dtype or torch.float32
    a, b = _x((D,), wdtype, seed=8), _x((D,), wdtype, seed=9)
    b[::3] = a[::3]  # exact zeros of the difference
    keys = _keys(None, seed=4)
    for rounding in [None] if dtype else HALF:
        want = c.sparse((a - b).to(rounding or wdtype), keys)
        got = c.sparse_difference(a, b, keys, dtype=rounding)
        assert torch.equal(got[0], want[0])
        assert got[1].dtype == want[1].dtype and torch.equal(_bits(got[1]), _bits(want[1]))


@pytest.mark.parametrize("spec", [s for s in ALL if make_compressor(s).sparse_batches])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_shifted_form_is_the_shifted_form(spec: str, dtype: torch.dtype) -> None:
    """C.shifted_sparse(x, h, keys) = (flat positions, values, h + c) of c = C(x − h, keys) for
    a batch (the simulator's sparse message batches): the pairs scatter to ``shifted``'s dense
    c bit for bit, and the new h equals ``shifted``'s except that −0 entries of h away from
    the kept positions stay −0 (h_j itself instead of h_j + 0)."""
    c = make_compressor(spec)
    x, h = _x((5, D), dtype, seed=11), _x((5, D), dtype, seed=12)
    h[:, 1] = -0.0
    keys = _keys(5, seed=6)
    flat, vals, g = c.shifted_sparse(x, h, keys)
    dense_c, dense_g = c.shifted(x, h, keys)
    assert flat.dtype == torch.int64 and flat.ndim == 1 and vals.shape == flat.shape
    assert ((flat // D) == torch.arange(5).repeat_interleave(flat.numel() // 5)).all()  # by row
    scattered = torch.zeros(5 * D, dtype=dtype).scatter_(0, flat, vals).view(5, D)
    assert torch.equal(_bits(scattered), _bits(dense_c))
    kept = torch.zeros(5 * D, dtype=torch.bool)
    kept[flat] = True
    kept = kept.view(5, D)
    assert torch.equal(_bits(g[kept]), _bits(dense_g[kept]))
    assert torch.equal(_bits(g[~kept]), _bits(h[~kept]))


@pytest.mark.parametrize("spec", [s for s in ALL if not make_compressor(s).sparse_batches])
def test_other_compressors_have_no_sparse_shifted_form(spec: str) -> None:
    x = _x((2, D), torch.float64)
    with pytest.raises(TypeError, match="sparse form of batches"):
        make_compressor(spec).shifted_sparse(x, x, _keys(2))


@pytest.mark.parametrize("spec", [s for s in ALL if make_compressor(s).encodes_pairs])
@pytest.mark.parametrize("dtype", DTYPES + HALF)
def test_encode_pairs_is_encode(spec: str, dtype: torch.dtype) -> None:
    """encode_pairs(*sparse(x, keys), d) is encode(x, keys) byte for byte (16-bit values for
    16-bit inputs), also into a preallocated ``out``; a wrong number of pairs is refused."""
    c = make_compressor(spec)
    x = _x((D,), dtype, seed=3)
    keys = _keys(None, seed=2)
    idx, vals = c.sparse(x, keys)
    want = c.encode(x, keys)
    assert torch.equal(c.encode_pairs(idx, vals, D), want)
    out = torch.full((want.numel() + 3,), 255, dtype=torch.uint8)
    assert torch.equal(c.encode_pairs(idx, vals, D, out=out), want)
    with pytest.raises(ValueError, match="pairs"):
        c.encode_pairs(idx[:-1], vals[:-1], D)


@pytest.mark.parametrize("spec", [s for s in ALL if make_compressor(s).sparse_message])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("d", [D, 37])
def test_decode_sparse_many_is_decode_sparse_per_message(
    spec: str, dtype: torch.dtype, d: int
) -> None:
    """decode_sparse_many over messages at arbitrary byte offsets of one buffer (a DDP hook's
    all-gather) gives decode_sparse of each, converted to float32 and multiplied by its weight
    (one rounded product), concatenated in message order — bit for bit, whichever path
    (Sparsifiers' one-call kernel, or the default loop); a span that is too short is refused."""
    _check_decode_sparse_many(make_compressor(spec), dtype, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_sparse_many_of_length_one_vectors(dtype: torch.dtype) -> None:
    # d = 1: indices of 0 bits (every message is its value alone)
    _check_decode_sparse_many(make_compressor("top_k[k=1]"), dtype, 1)


def _check_decode_sparse_many(c: Compressor, dtype: torch.dtype, d: int) -> None:
    n = 3
    keys = [_keys(None, seed=10 + j) for j in range(n)]
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    payloads = [c.encode(_x((d,), dtype, seed=20 + j), keys[j]) for j in range(n)]
    gaps = [1, 6, 3]  # so that messages start on odd byte offsets
    buf_parts, spans, pos = [], [], 0
    for gap, p in zip(gaps, payloads, strict=True):
        buf_parts += [torch.full((gap,), 0xA5, dtype=torch.uint8), p]
        spans.append((pos + gap, p.numel()))
        pos += gap + p.numel()
    buf = torch.cat(buf_parts)
    weights = [0.25, 1.0 / 3.0, 0.7]
    idx, vals = c.decode_sparse_many(buf, spans, d, dtype, weights, keys, out_dtype)
    want_i, want_v = [], []
    for p, w, kj in zip(payloads, weights, keys, strict=True):
        i, v = c.decode_sparse(p, d, dtype, kj)
        want_i.append(i)
        want_v.append(v.to(out_dtype) * torch.tensor(w, dtype=out_dtype))
    assert torch.equal(idx, torch.cat(want_i))
    assert vals.dtype == out_dtype
    assert torch.equal(_bits(vals), _bits(torch.cat(want_v)))
    short = [(spans[0][0], spans[0][1] - 1), *spans[1:]]
    if payloads[0].numel() > 1 or isinstance(c, base.Sparsifier):
        with pytest.raises(ValueError, match="too short"):
            c.decode_sparse_many(buf, short, d, dtype, weights, keys, out_dtype)


def test_fixed_size_sparsifiers_encode_pairs() -> None:
    # every fixed-size sparsifier (its message: k pairs) encodes from its sparse form
    for spec in ALL:
        c = make_compressor(spec)
        if isinstance(c, base.Sparsifier):
            assert c.encodes_pairs, spec


@pytest.mark.parametrize("spec", [s for s in ALL if not make_compressor(s).sparse_message])
def test_dense_messages_have_no_sparse_form(spec: str) -> None:
    with pytest.raises(TypeError, match="no sparse form"):
        make_compressor(spec).sparse(_x((D,), torch.float32), _keys(None))


_SPEC = st.sampled_from(ALL)
_FLOATS = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)


@given(spec=_SPEC, values=st.lists(_FLOATS, min_size=D, max_size=D), seed=st.integers(0, 2**40))
def test_property_round_trip_and_finiteness(spec: str, values: list[float], seed: int) -> None:
    c: Compressor = make_compressor(spec)
    x = torch.tensor(values, dtype=torch.float32)
    keys = Keys.derive(seed, round=seed % 7, client=seed % 5)
    y = c(x, keys)
    assert bool(torch.isfinite(y).all())
    assert torch.equal(c.decode(c.encode(x, keys), D, torch.float32, keys), y)
    assert float(c.message_bits(y[None])[0]) <= c.bits(D) or c.variable_size
