"""Keyed counter-based randomness: three arithmetics agree, draws are keyed and uniform."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shrinkgrad import rng
from shrinkgrad.rng import Keys, KeyStream


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=50))
def test_mix32_implementations_agree(values: list[int]) -> None:
    a = np.array(values, dtype=np.uint32)
    ref = [rng.mix32_int(v) for v in values]
    assert rng.mix32_numpy(a).tolist() == ref
    assert rng.mix32_torch(torch.tensor(values, dtype=torch.int64)).tolist() == ref


def test_mix32_is_a_bijection_on_a_block() -> None:
    x = np.arange(1 << 16, dtype=np.uint32) * np.uint32(65537)
    assert len(np.unique(rng.mix32_numpy(x))) == x.size


def test_bits32_torch_equals_numpy() -> None:
    k = Keys.derive(7, round=3, client=np.arange(5))
    lo, hi = k.numpy()
    j = np.arange(100, dtype=np.uint32)
    ref = rng.bits32_numpy(lo[:, None], hi[:, None], j[None, :])
    assert np.array_equal(k.bits32(100).numpy(), ref.astype(np.int64))


def test_batched_keys_equal_single_client_keys() -> None:
    batch = Keys.derive(11, round=9, client=np.arange(6)).bits32(32)
    for i in range(6):
        single = Keys.derive(11, round=9, client=i).bits32(32)
        assert torch.equal(batch[i], single)


def test_keys_differ_across_seed_round_client_stream() -> None:
    base = Keys.derive(1, round=2, client=3).bits32(8)
    for other in (
        Keys.derive(2, round=2, client=3),
        Keys.derive(1, round=3, client=3),
        Keys.derive(1, round=2, client=4),
        Keys.derive(1, round=2, client=3, stream="participation"),
        Keys.derive(1, round=2, client=3).fold(1),
    ):
        assert not torch.equal(other.bits32(8), base)


def test_keystream_matches_derive_and_large_rounds() -> None:
    ks = KeyStream(5, np.arange(3), stream="minibatch")
    for r in (0, 1, 2**40 + 3):
        a, b = ks.at(r), Keys.derive(5, round=r, client=np.arange(3), stream="minibatch")
        assert torch.equal(a.lo, b.lo) and torch.equal(a.hi, b.hi)


def test_uniform_moments_within_monte_carlo_tolerance() -> None:
    # 10^6 draws: the sample mean has std 1/sqrt(12 N); 6 sigma can never fail by chance.
    n = 1000
    for dtype in (torch.float64, torch.float32):
        u = Keys.derive(3, client=np.arange(n)).uniform(n, dtype)
        assert u.dtype == dtype
        assert float(u.min()) > 0.0 and float(u.max()) < 1.0
        N = u.numel()
        assert abs(float(u.double().mean()) - 0.5) < 6 / math.sqrt(12 * N)
        # fraction below 1/4: binomial with sd sqrt(p(1-p)/N)
        frac = float((u < 0.25).double().mean())
        assert abs(frac - 0.25) < 6 * math.sqrt(0.25 * 0.75 / N)


def test_bad_seeds_are_rejected() -> None:
    with pytest.raises(ValueError, match="seed"):
        Keys.derive(-1)
    with pytest.raises(TypeError, match="seed"):
        Keys.derive(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="client ids"):
        Keys.derive(1, client=[-1])


def test_expand_broadcasts_a_scalar_key() -> None:
    k = Keys.derive(1, client=0)
    e = k.expand((3,))
    assert e.shape == (3,)
    with pytest.raises(ValueError, match="do not match"):
        Keys.derive(1, client=np.arange(2)).expand((3,))


def _tensor_key(k: Keys) -> Keys:
    """The tensor-backed key of the same two words as ``k``."""
    one = k.scalar()
    assert one is not None
    return Keys(torch.tensor(one[0]), torch.tensor(one[1]))


def test_a_scalar_key_draws_what_the_tensor_key_of_its_words_draws() -> None:
    from shrinkgrad.compressors import make_compressor

    k = KeyStream(5, 3, stream="ddp_hook").at(17)  # one client: a ScalarKey
    assert isinstance(k, rng.ScalarKey)
    t = _tensor_key(k)
    assert not isinstance(t, rng.ScalarKey)
    assert k.scalar() == t.scalar() == (int(k.lo), int(k.hi))
    assert (k.shape, k.device) == (t.shape, t.device)
    assert k.fold(9).scalar() == t.fold(9).scalar()
    assert k.fold("rand_k").scalar() == t.fold("rand_k").scalar()
    assert [a.tolist() for a in k.numpy()] == [a.tolist() for a in t.numpy()]
    assert torch.equal(k.bits32(64), t.bits32(64))
    assert torch.equal(k.uniform(64, torch.float32), t.uniform(64, torch.float32))
    assert torch.equal(k.expand((3,)).bits32(8), t.expand((3,)).bits32(8))
    assert k.expand(()) is k and k.to("cpu") is k
    again = pickle.loads(pickle.dumps(k))  # (keys cross process boundaries in the runners)
    assert isinstance(again, rng.ScalarKey) and again.scalar() == k.scalar()
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    for name in ("rand_k[k=30]", "rand_k[k=30,shared_seed=true]", "qsgd[s=4]", "natural"):
        C = make_compressor(name)
        assert torch.equal(C(x, k), C(x, t)), name
        if C.sparse_message:
            (i1, v1), (i2, v2) = C.sparse(x, k), C.sparse(x, t)
            assert torch.equal(i1, i2) and torch.equal(v1, v2), name


def test_rand_k_draws_from_a_scalar_key_without_making_its_tensors() -> None:
    """The hook's per-tensor draw reads the key's ints: no torch tensor is created for it
    (tens of µs each right after a kernel has streamed a gradient through the caches)."""
    from shrinkgrad.compressors import make_compressor

    k = KeyStream(1, 0, stream="ddp_hook").at(2).fold(4)
    C = make_compressor("rand_k[k=50,shared_seed=true]")
    idx, _ = C.sparse(torch.randn(5000), k)
    assert k.__dict__["_tensors"] is None
    assert torch.equal(idx, C.sparse(torch.randn(5000), _tensor_key(k))[0])


def test_a_scalar_key_takes_32_bit_words_only() -> None:
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        rng.ScalarKey(-1, 0)
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        rng.ScalarKey(0, 1 << 32)
