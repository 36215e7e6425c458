"""Keyed, counter-based randomness: every random draw is a pure function of its coordinates.

Design principle 4 of shrinkgrad: randomness is *explicit* and keyed by ``(seed, stream, client,
round)``; the global generators of torch/numpy are never used. Consequences that the tests check:

* the same seed gives the same run, on any device and in any process;
* compressing ``n`` clients in one batched call gives exactly what ``n`` separate calls with the
  clients' own keys give (each row only sees its own key);
* a distributed rank draws exactly what the simulator draws for the same client.

Construction
------------
A *row key* is 64 bits, stored as two 32-bit words ``(lo, hi)``. It is derived from the words
``seed_lo, seed_hi, stream, client, round_lo, round_hi`` by two chains of
``h ← mix32(h ⊕ w)`` (different initial values), where ``mix32`` is the bijective
"lowbias32" integer hash (C. Wellons, *hash-prospector*). ``stream`` is the CRC-32 of a purpose
string ("compressor", "participation", "minibatch", ...), so different purposes never share bits.

The ``j``-th 32-bit word of a row is ``bits32(lo, hi, j) = mix32((mix32(j ⊕ lo) + hi) mod 2³²)``,
the counter ``j`` taken modulo 2³² on every path. For a fixed key this is a bijection of
``j mod 2³²`` (a counter-based generator in the spirit of Philox, Salmon et al. 2011), so any
coordinate's random word can be computed independently, vectorised over rows and columns, on CPU
(numpy / numba) or any torch device, with bit-identical results.

The two chains are one chain from two starting points: ``hi`` of a key is ``lo`` of the key
whose ``seed_lo`` is XORed with ``_INIT_LO ⊕ _INIT_HI``, and, under one (seed, stream), ``hi`` of
client c is ``lo`` of client c ⊕ D for a pseudo-random D = D(seed, stream), so those two clients
hold swapped keys (lo, hi) and (hi, lo) in every round. Swapped keys are distinct and draw
unrelated words (``lo`` and ``hi`` enter ``bits32`` differently). Each chain step is a bijection
of its word, so with everything else fixed, distinct clients (or distinct rounds below 2³², or
distinct seeds below 2³²) never share a key; two keys differing in several coordinates coincide
only as two random 64-bit values do.

Three implementations of ``mix32`` exist (numpy ``uint32``, torch ``int64`` with exact 32-bit
multiplication, numba scalar) and a test checks that they agree bit for bit.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch

__all__ = [
    "KeyStream",
    "Keys",
    "ScalarKey",
    "bits32_numpy",
    "bits32_torch",
    "mix32_numpy",
    "mix32_torch",
    "stream_id",
]

MASK32 = 0xFFFFFFFF
_C1 = 0x7FEB352D
_C2 = 0x846CA68B
_INIT_LO = 0x243F6A88  # digits of pi, any fixed distinct constants do
_INIT_HI = 0x85A308D3
#: significand bits (with the implicit bit) of the dtypes :meth:`Keys.uniform` draws below float64
_SIGNIFICAND_BITS = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


# --------------------------------------------------------------------------------------------
# mix32 in three arithmetics
# --------------------------------------------------------------------------------------------
def mix32_int(x: int) -> int:
    """lowbias32 on a Python int (reference implementation)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _C1) & MASK32
    x ^= x >> 15
    x = (x * _C2) & MASK32
    x ^= x >> 16
    return x


def mix32_numpy(x: np.ndarray) -> np.ndarray:
    """lowbias32 on a ``uint32`` array (numpy's unsigned arithmetic wraps modulo 2³²)."""
    x = np.asarray(x, dtype=np.uint32)
    with np.errstate(over="ignore"):  # 0-d arrays become scalars, which warn on (intended) wrap
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(_C1)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(_C2)
        return np.asarray(x ^ (x >> np.uint32(16)), dtype=np.uint32)


def _mul32_torch(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x · c) mod 2³² for int64 ``x`` in [0, 2³²), without signed 64-bit overflow."""
    if c < (1 << 31):
        return (x * c) & MASK32
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def mix32_torch(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an ``int64`` tensor holding values in [0, 2³²) (any device)."""
    x = x ^ (x >> 16)
    x = _mul32_torch(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32_torch(x, _C2)
    return x ^ (x >> 16)


@lru_cache(maxsize=256)
def stream_id(name: str) -> int:
    """A stable 32-bit id for a purpose string (CRC-32; Python's ``hash`` is salted per process)."""
    return zlib.crc32(name.encode("utf-8")) & MASK32


def _split64(v: int, what: str) -> tuple[int, int]:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{what} must be an integer, got {type(v).__name__}")
    v = int(v)
    if v < 0 or v >= 1 << 64:
        raise ValueError(f"{what} must be in [0, 2**64), got {v}")
    return v & MASK32, v >> 32


# --------------------------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Keys:
    """Per-row 64-bit keys ``(lo, hi)``: one key for every row of a batch of shape ``shape``.

    ``lo`` and ``hi`` are ``int64`` tensors holding values in [0, 2³²). A compressor applied to a
    tensor of shape ``(..., d)`` takes keys of shape ``(...)`` (or a scalar key, broadcast).
    """

    lo: torch.Tensor
    hi: torch.Tensor

    # construction ---------------------------------------------------------------------------
    @classmethod
    def derive(
        cls,
        seed: int,
        *,
        round: int = 0,
        client: int | Sequence[int] | np.ndarray | torch.Tensor = 0,
        stream: str = "compressor",
        device: torch.device | str | None = None,
    ) -> Keys:
        """Keys of ``client`` (an int or an array of client ids) at ``round`` under ``seed``."""
        return KeyStream(seed, client, stream=stream, device=device).at(round)

    @classmethod
    def from_numpy(
        cls, lo: np.ndarray, hi: np.ndarray, device: torch.device | str | None = None
    ) -> Keys:
        t_lo = torch.from_numpy(np.array(lo, dtype=np.uint32).astype(np.int64))
        t_hi = torch.from_numpy(np.array(hi, dtype=np.uint32).astype(np.int64))
        if device is not None:
            t_lo, t_hi = t_lo.to(device), t_hi.to(device)
        return cls(t_lo, t_hi)

    # views ----------------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return self.lo.shape

    @property
    def device(self) -> torch.device:
        return self.lo.device

    def __getitem__(self, idx: Any) -> Keys:
        return Keys(self.lo[idx], self.hi[idx])

    def reshape(self, *shape: int) -> Keys:
        return Keys(self.lo.reshape(*shape), self.hi.reshape(*shape))

    def expand(self, shape: Sequence[int]) -> Keys:
        """Broadcast to a batch shape (a scalar key becomes the same key for every row)."""
        shape = tuple(shape)
        if tuple(self.shape) == shape:
            return self
        try:
            return Keys(self.lo.expand(shape), self.hi.expand(shape))
        except RuntimeError:
            raise ValueError(
                f"keys of shape {tuple(self.shape)} do not match a batch of shape {shape}: give "
                "one key per row (Keys.derive(seed, round=t, client=clients)) or a single key"
            ) from None

    def to(self, device: torch.device | str) -> Keys:
        return Keys(self.lo.to(device), self.hi.to(device))

    def numpy(self) -> tuple[np.ndarray, np.ndarray]:
        """The two words as contiguous ``uint32`` numpy arrays (for numba kernels)."""
        lo = np.array(self.lo.detach().cpu().numpy(), dtype=np.uint32)
        hi = np.array(self.hi.detach().cpu().numpy(), dtype=np.uint32)
        return lo, hi

    def scalar(self) -> tuple[int, int] | None:
        """A single CPU key's two words as Python ints; None for a batch or a device key."""
        if self.lo.ndim == 0 and self.lo.device.type == "cpu":
            return int(self.lo), int(self.hi)
        return None

    # derived streams ------------------------------------------------------------------------
    def fold(self, tag: int | str) -> Keys:
        """Independent sub-keys, e.g. for the second stage of a composed compressor."""
        t = stream_id(tag) if isinstance(tag, str) else (int(tag) & MASK32)
        one = self.scalar()
        if one is not None:  # one key: Python ints (µs)
            return ScalarKey(
                mix32_int(one[0] ^ mix32_int(t ^ _INIT_LO)),
                mix32_int(one[1] ^ mix32_int(t ^ _INIT_HI)),
            )
        lo = mix32_torch(self.lo ^ mix32_int(t ^ _INIT_LO))
        hi = mix32_torch(self.hi ^ mix32_int(t ^ _INIT_HI))
        return Keys(lo, hi)

    # draws ----------------------------------------------------------------------------------
    def bits32(self, d: int, *, offset: int = 0) -> torch.Tensor:
        """Random 32-bit words, shape ``(*self.shape, d)``, ``int64`` values in [0, 2³²)."""
        j = torch.arange(offset, offset + d, dtype=torch.int64, device=self.device)
        return bits32_torch(self.lo[..., None], self.hi[..., None], j)

    def uniform(
        self, d: int, dtype: torch.dtype = torch.float64, *, offset: int = 0
    ) -> torch.Tensor:
        """Uniform draws in the open interval (0, 1), shape ``(*self.shape, d)``.

        float64 uses all 32 bits: u = (w + ½)/2³². A dtype with a p-bit significand (float32:
        24, float16: 11, bfloat16: 8) uses the top p − 1 bits, u = (⌊w/2^(33−p)⌋ + ½)/2^(p−1):
        every value (2m + 1)/2^p has p significant bits and is a normal number, so it is exactly
        representable and never 0 or 1 (with p bits, (m + ½)/2^p would round to 1 for the top m).
        """
        w = self.bits32(d, offset=offset)
        if dtype == torch.float64:
            return (w.to(torch.float64) + 0.5) * 2.0**-32
        p = _SIGNIFICAND_BITS.get(dtype)
        if p is None:
            raise TypeError(f"uniform draws need a floating dtype, got {dtype}")
        m = (w >> (33 - p)).to(torch.float32)  # < 2^(p−1): m + ½ is exact in float32
        return (m + 0.5).mul_(2.0 ** (1 - p)).to(dtype)


class ScalarKey(Keys):
    """One CPU key held as two Python ints (``Keys`` of shape ``()``): what a one-client
    :class:`KeyStream` and :meth:`Keys.fold` of such a key give, e.g. the DDP hook's keys (one
    per tensor and round). Its ``lo``/``hi`` tensors are made on first use only: a compressor
    that reads the ints (:meth:`scalar`: rand-k's index draw, :meth:`fold`) never creates them
    — a few µs each, and tens of µs when the hook's kernels have just streamed a gradient
    through the caches. Everything else behaves as the tensor-backed key of the same words
    (the same draws, bit for bit)."""

    _ints: tuple[int, int]

    def __init__(self, lo: int, hi: int) -> None:
        if not (0 <= lo <= MASK32 and 0 <= hi <= MASK32):
            raise ValueError(f"a key's words must be in [0, 2**32), got ({lo}, {hi})")
        object.__setattr__(self, "_ints", (int(lo), int(hi)))
        object.__setattr__(self, "_tensors", None)

    def _made(self) -> tuple[torch.Tensor, torch.Tensor]:
        made: tuple[torch.Tensor, torch.Tensor] | None = self.__dict__["_tensors"]
        if made is None:
            lo, hi = self._ints
            made = (torch.tensor(lo), torch.tensor(hi))
            object.__setattr__(self, "_tensors", made)
        return made

    @property
    def lo(self) -> torch.Tensor:
        return self._made()[0]

    @property
    def hi(self) -> torch.Tensor:
        return self._made()[1]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(())

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def scalar(self) -> tuple[int, int]:
        lo, hi = self._ints
        return lo, hi

    def expand(self, shape: Sequence[int]) -> Keys:
        return self if tuple(shape) == () else super().expand(shape)

    def to(self, device: torch.device | str) -> Keys:
        return self if torch.device(device).type == "cpu" else super().to(device)

    def __repr__(self) -> str:
        return f"ScalarKey(lo={self._ints[0]}, hi={self._ints[1]})"


def bits32_torch(lo: torch.Tensor, hi: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """``mix32((mix32(j ⊕ lo) + hi) mod 2³²)`` with broadcasting (int64 tensors).

    The counter is taken modulo 2³² as the numpy (``uint32``) and numba (masked) twins take it:
    :func:`mix32_torch` needs its input in [0, 2³²), and a counter ≥ 2³² (the tie words
    ``2j``, ``2j + 1`` of :func:`~shrinkgrad.compressors._random.draw_up` for d > 2³¹) would
    otherwise shift its high bits into the word and differ from the CPU kernels' draw."""
    return mix32_torch((mix32_torch((j & MASK32) ^ lo) + hi) & MASK32)


def bits32_numpy(lo: np.ndarray, hi: np.ndarray, j: np.ndarray) -> np.ndarray:
    """The numpy twin of :func:`bits32_torch` on ``uint32`` arrays."""
    lo = np.asarray(lo, dtype=np.uint32)
    hi = np.asarray(hi, dtype=np.uint32)
    j = np.asarray(j, dtype=np.uint32)
    with np.errstate(over="ignore"):
        return mix32_numpy(mix32_numpy(j ^ lo) + hi)


class KeyStream:
    """The keys of a fixed set of clients under one ``seed`` and ``stream``, for any round.

    The seed/stream/client part of the chain is computed once; :meth:`at` only mixes in the round,
    so deriving keys costs a few vector operations per round whatever the number of clients.
    """

    def __init__(
        self,
        seed: int,
        clients: int | Sequence[int] | np.ndarray | torch.Tensor = 0,
        *,
        stream: str = "compressor",
        device: torch.device | str | None = None,
    ) -> None:
        s_lo, s_hi = _split64(seed, "seed")
        if isinstance(clients, torch.Tensor):
            c = clients.detach().cpu().numpy()
        else:
            c = np.asarray(clients)
        if c.dtype.kind not in "iu" and c.size:
            raise TypeError(f"client ids must be integers, got dtype {c.dtype}")
        if c.size and (c.min() < 0 or c.max() > MASK32):
            raise ValueError("client ids must be in [0, 2**32)")
        c = c.astype(np.uint32)
        sid = stream_id(stream)
        lo_i, hi_i = _INIT_LO, _INIT_HI  # the scalar part of the chain, in Python ints
        for w in (s_lo, s_hi, sid):
            lo_i = mix32_int(lo_i ^ w)
            hi_i = mix32_int(hi_i ^ w)
        if c.ndim == 0:
            self._lo = np.asarray(mix32_int(lo_i ^ int(c)), dtype=np.uint32)
            self._hi = np.asarray(mix32_int(hi_i ^ int(c)), dtype=np.uint32)
        else:
            self._lo = mix32_numpy(np.uint32(lo_i) ^ c)
            self._hi = mix32_numpy(np.uint32(hi_i) ^ c)
        self.seed = int(seed)
        self.stream = stream
        self.shape = c.shape
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    def at(self, round: int) -> Keys:
        """Keys of every client of this stream at ``round``."""
        r_lo, r_hi = _split64(round, "round")
        if self._lo.ndim == 0:  # one client: Python ints (µs instead of numpy's 0-d overhead)
            lo_i = mix32_int(mix32_int(int(self._lo) ^ r_lo) ^ r_hi)
            hi_i = mix32_int(mix32_int(int(self._hi) ^ r_lo) ^ r_hi)
            keys = ScalarKey(lo_i, hi_i)
            return keys if self.device.type == "cpu" else keys.to(self.device)
        lo = mix32_numpy(mix32_numpy(self._lo ^ np.uint32(r_lo)) ^ np.uint32(r_hi))
        hi = mix32_numpy(mix32_numpy(self._hi ^ np.uint32(r_lo)) ^ np.uint32(r_hi))
        return Keys.from_numpy(np.asarray(lo), np.asarray(hi), self.device)
