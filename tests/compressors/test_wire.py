"""The wire format: the numba bit packer against a plain reference packer, the CPU codecs
against the torch path (same bytes, cross-decodable), ``decode(out=)``, ``encode(out=)`` and
``decode_sparse``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from compressor_examples import ALL, D

from shrinkgrad import Keys, make_compressor
from shrinkgrad.compressors import base
from shrinkgrad.compressors._kernels import CHUNK
from shrinkgrad.compressors._wire import BitReader, BitWriter, pack_bits, unpack_bits

Field = tuple[str, np.ndarray, int]  # ("ints", values, width) or ("f32"/"f64", values, 0)


# --------------------------------------------------------------------------------------------
# a reference bit packer: Python integers, one field after the other
# --------------------------------------------------------------------------------------------
def _reference_bytes(fields: list[Field]) -> bytes:
    acc = 0
    pos = 0
    for kind, values, width in fields:
        if kind == "ints":
            words, w = [int(v) for v in values], width
        elif kind == "f32":
            words, w = [int(v) for v in values.astype(np.float32).view(np.uint32)], 32
        else:  # float64: low 32-bit word, then high
            words = []
            for v in values.astype(np.float64).view(np.uint64):
                words += [int(v) & 0xFFFFFFFF, int(v) >> 32]
            w = 32
        for v in words:
            assert 0 <= v < 1 << w
            acc |= v << pos
            pos += w
    return acc.to_bytes((pos + 7) // 8, "little")


def _random_fields(rng: np.random.Generator) -> list[Field]:
    fields: list[Field] = []
    for _ in range(int(rng.integers(1, 7))):
        kind = str(rng.choice(["ints", "ints", "ints", "f32", "f64"]))
        count = int(rng.choice([0, 1, 3, 7, 8, 9, 17, 64, 1001]))
        if kind == "ints":
            width = int(rng.integers(1, 33))
            values = rng.integers(0, 1 << width, count, dtype=np.uint64)
            fields.append((kind, values, width))
        else:
            values = rng.standard_normal(count) * 10.0 ** rng.integers(-30, 30, count)
            fields.append((kind, values, 0))
    return fields


def _write(fields: list[Field], fast: bool) -> torch.Tensor:
    w = BitWriter("cpu", fast=fast)
    for kind, values, width in fields:
        if kind == "ints":
            w.add(torch.from_numpy(values.astype(np.int64)), width)
        else:
            w.add_float(
                torch.from_numpy(values.astype(np.float32 if kind == "f32" else np.float64))
            )
    return w.to_bytes()


def _read_back(payload: torch.Tensor, fields: list[Field], fast: bool) -> None:
    r = BitReader(payload, fast=fast)
    for kind, values, width in fields:
        if kind == "ints":
            got = r.read(values.size, width)
            assert got.tolist() == [int(v) for v in values]
        else:
            dtype = torch.float32 if kind == "f32" else torch.float64
            got = r.read_float(values.size, dtype)
            want = values.astype(np.float32 if kind == "f32" else np.float64)
            assert got.numpy().tobytes() == want.tobytes()
    assert r.pos == sum(
        (v.size * w if k == "ints" else v.size * (32 if k == "f32" else 64)) for k, v, w in fields
    )


@pytest.mark.parametrize("seed", range(40))
def test_writer_and_reader_match_the_reference_packer(seed: int) -> None:
    """Random sequences of fields of every width 1..32, lengths not multiples of 8 and floats
    at arbitrary bit offsets: both packers give the reference bytes, both readers read them."""
    fields = _random_fields(np.random.default_rng(seed))
    ref = _reference_bytes(fields)
    for fast in (True, False):
        payload = _write(fields, fast)
        assert bytes(payload.numpy()) == ref, f"fast={fast}"
        _read_back(payload, fields, fast)


@pytest.mark.parametrize("width", [1, 2, 3, 5, 7, 8, 9, 12, 13, 16, 17, 26, 31, 32])
@pytest.mark.parametrize("offset", [0, 3, 7, 8, 13])
def test_pack_bits_keeps_earlier_bits_and_zeroes_the_padding(width: int, offset: int) -> None:
    rng = np.random.default_rng(width * 100 + offset)
    n = 8 * 37 + 5  # groups of 8 and a tail
    codes = rng.integers(0, 1 << width, n, dtype=np.uint64).astype(np.uint32)
    out = np.full((offset + n * width + 7) // 8 + 2, 0xFF, dtype=np.uint8)
    pack_bits(codes, width, out, offset)
    nbytes = (offset + n * width + 7) // 8
    bits = int.from_bytes(bytes(out[:nbytes]), "little")
    assert bits & ((1 << offset) - 1) == (1 << offset) - 1  # earlier bits untouched
    want = 0
    for i, c in enumerate(codes):
        want |= int(c) << (i * width)
    assert bits >> offset == want  # the fields, then zero padding in the last byte
    assert list(out[nbytes:]) == [0xFF, 0xFF]  # nothing written beyond
    back = np.empty(n, dtype=np.uint32)
    unpack_bits(out, offset, width, back)
    assert np.array_equal(back, codes)


# --------------------------------------------------------------------------------------------
# compressors: the CPU codecs against the torch path
# --------------------------------------------------------------------------------------------
def _same(a: torch.Tensor, b: torch.Tensor, spec: str) -> bool:
    """Bit for bit (−0.0 ≠ +0.0), Bernoulli included: it outputs a kept −0.0 as +0.0, which is
    what its message (kept non-zeros only) decodes to."""
    ints = torch.int32 if a.dtype == torch.float32 else torch.int64
    return torch.equal(a.view(ints), b.view(ints))


def _vector(d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Magnitudes over many binades, zeros, a −0.0, ties and a few subnormal-sized entries."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(d, generator=g, dtype=torch.float64)
    x *= 10.0 ** torch.randint(-3, 4, (d,), generator=g)
    x[:: max(2, d // 50)] = 0.0
    x[min(1, d - 1)] = -0.0
    if d > 40:
        x[10:20] = 2.5  # ties (Top-k)
        x[30:33] = 1e-39  # subnormal in float32 (natural compression)
    return x.to(dtype)


def _encode(spec: str, x: torch.Tensor, keys: Keys, mode: str, mp: pytest.MonkeyPatch):
    mp.setattr(base, "KERNELS", mode)
    c = make_compressor(spec)
    return c, c(x, keys), c.encode(x, keys)


@pytest.mark.parametrize("spec", ALL)
@pytest.mark.parametrize("d", [D + 3, 3001, 2 * CHUNK + 5])
def test_fast_and_torch_wire_paths_agree(
    spec: str, d: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32: both paths send the same bytes; each payload decodes, on either path, to its
    own path's C(x) exactly (several chunks, unaligned blocks after k odd-width indices)."""
    if d == 3001:  # 1001 indices of 12 bits: the blocks after them start mid-byte
        spec = spec.replace("top_k[k=3]", "top_k[k=1001]")
    x = _vector(d, torch.float32, seed=d)
    keys = Keys.derive(5, round=1, client=2)
    _, y_t, p_t = _encode(spec, x, keys, "torch", monkeypatch)
    c, y_f, p_f = _encode(spec, x, keys, "numba", monkeypatch)
    assert torch.equal(p_f, p_t)
    assert p_f.numel() == math.ceil(float(c.message_bits(y_f[None])[0]) / 8)
    for mode in ("numba", "torch"):
        monkeypatch.setattr(base, "KERNELS", mode)
        for payload, y in ((p_f, y_f), (p_t, y_t)):
            assert _same(c.decode(payload, d, torch.float32, keys), y, spec), mode


@pytest.mark.parametrize(
    "spec", ["qsgd[s=4]", "qsgd[s=300]", "ternary", "natural", "natural_dithering[s=5]"]
)
def test_fast_wire_float64_round_trip(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """float64 (12-bit natural codes, 64-bit norms): round trip exact on both paths, and each
    path's payload decodes to its C(x) on the other (the norms differ in the last bit between
    the paths, as documented, so the payloads themselves need not be equal)."""
    d = CHUNK + 77
    x = _vector(d, torch.float64, seed=3)
    keys = Keys.derive(6, round=0, client=1)
    _, y_t, p_t = _encode(spec, x, keys, "torch", monkeypatch)
    c, y_f, p_f = _encode(spec, x, keys, "numba", monkeypatch)
    assert p_f.numel() == p_t.numel() == math.ceil(c.bits(d, torch.float64) / 8)
    for mode in ("numba", "torch"):
        monkeypatch.setattr(base, "KERNELS", mode)
        for payload, y in ((p_f, y_f), (p_t, y_t)):
            assert torch.equal(
                c.decode(payload, d, torch.float64, keys).view(torch.int64), y.view(torch.int64)
            )


@pytest.mark.parametrize("spec", ["natural", "qsgd[s=2]", "scaled_sign", "identity", "top_k[k=2]"])
def test_encode_rejects_non_finite_input(spec: str) -> None:
    c = make_compressor(spec)
    for bad in (math.inf, math.nan):
        x = torch.randn(CHUNK + 9)
        x[CHUNK + 3] = bad
        with pytest.raises(ValueError, match="non-finite"):
            c.encode(x, Keys.derive(0))


def test_natural_encode_reports_overflow() -> None:
    x = torch.ones(50)
    x[7] = 3.0e38  # rounds up to 2^128 with positive probability: refused
    with pytest.raises(ValueError, match="overflows"):
        make_compressor("natural").encode(x, Keys.derive(0))


# --------------------------------------------------------------------------------------------
# out= and decode_sparse
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ALL)
def test_decode_out_argument(spec: str) -> None:
    c = make_compressor(spec)
    x = _vector(D, torch.float32, seed=11)
    keys = Keys.derive(2, round=4, client=0)
    payload = c.encode(x, keys)
    ref = c(x, keys)
    buf = torch.full((D,), 7.0)
    assert c.decode(payload, D, torch.float32, keys, out=buf) is buf
    assert _same(buf, ref, spec)
    strided = torch.full((D, 2), 3.0)[:, 1]  # not contiguous
    assert c.decode(payload, D, torch.float32, keys, out=strided) is strided
    assert torch.equal(strided, ref)
    assert torch.equal(c.decode(payload, D, torch.float32, keys), ref)  # the old call
    with pytest.raises(ValueError, match="out must be"):
        c.decode(payload, D, torch.float32, keys, out=torch.empty(D + 1))
    with pytest.raises(ValueError, match="out must be"):
        c.decode(payload, D, torch.float32, keys, out=torch.empty(D, dtype=torch.float64))


@pytest.mark.parametrize("spec", ["qsgd[s=4]", "top_k[k=3]", "bernoulli[p=0.3]", "identity"])
def test_encode_out_argument(spec: str) -> None:
    c = make_compressor(spec)
    x = _vector(D, torch.float32, seed=12)
    keys = Keys.derive(2)
    ref = c.encode(x, keys)
    buf = torch.full((ref.numel() + 5,), 0xAB, dtype=torch.uint8)
    got = c.encode(x, keys, out=buf)
    assert got.data_ptr() == buf.data_ptr() and torch.equal(got, ref)
    assert buf[ref.numel() :].tolist() == [0xAB] * 5
    with pytest.raises(ValueError, match="bytes"):
        c.encode(x, keys, out=torch.empty(ref.numel() - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        c.encode(x, keys, out=torch.empty(ref.numel()))


@pytest.mark.parametrize("spec", ALL)
def test_decode_sparse_gives_the_decoded_non_zeros(spec: str) -> None:
    c = make_compressor(spec)
    x = _vector(D, torch.float64, seed=13)
    keys = Keys.derive(3, round=1, client=0)
    payload = c.encode(x, keys)
    if not c.sparse_message:
        with pytest.raises(TypeError, match="dense"):
            c.decode_sparse(payload, D, torch.float64, keys)
        return
    idx, vals = c.decode_sparse(payload, D, torch.float64, keys)
    assert idx.dtype == torch.int64 and idx.unique().numel() == idx.numel()
    dense = torch.zeros(D, dtype=torch.float64).index_add_(0, idx, vals)
    assert torch.equal(dense, c.decode(payload, D, torch.float64, keys))
