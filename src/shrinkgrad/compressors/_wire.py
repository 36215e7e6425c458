"""Bit-level wire format shared by every compressor's ``encode`` / ``decode``.

A message is a sequence of *fields*: ``count`` unsigned integers of ``width`` bits each, written
least-significant bit first into one contiguous bit stream (no padding between fields), then
padded with zero bits to a whole byte. Floats travel as their IEEE bit patterns (32 bits for
float32, two 32-bit words, low then high, for float64). The payload of a message of ``b`` bits is
therefore exactly ``⌈b/8⌉`` bytes, which the contract tests check against ``bits(d)``.

Everything is plain torch on the tensors' device, so the format is the same on CPU and CUDA.
"""

from __future__ import annotations

import torch

__all__ = ["BitReader", "BitWriter", "float_width"]

_MASK32 = 0xFFFFFFFF


def float_width(dtype: torch.dtype) -> int:
    """Bits of one value of ``dtype`` on the wire."""
    return torch.finfo(dtype).bits


def _float_words(v: torch.Tensor) -> list[torch.Tensor]:
    """IEEE bit patterns of a float tensor as 32-bit words (int64 in [0, 2³²))."""
    v = v.reshape(-1).contiguous()
    if v.dtype == torch.float32:
        return [v.view(torch.int32).to(torch.int64) & _MASK32]
    if v.dtype == torch.float64:
        w = v.view(torch.int64)
        return [w & _MASK32, (w >> 32) & _MASK32]
    raise TypeError(f"the wire format carries float32 or float64 values, got {v.dtype}")


class BitWriter:
    """Collects fields; :meth:`to_bytes` packs them into one ``uint8`` payload."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._fields: list[tuple[torch.Tensor, int]] = []
        self.nbits = 0

    def add(self, values: torch.Tensor, width: int) -> None:
        """Append ``values`` (non-negative integers < 2^width) as ``width``-bit fields."""
        if width < 0 or width > 32:
            raise ValueError(f"field width must be in [0, 32], got {width}")
        v = values.reshape(-1).to(device=self.device, dtype=torch.int64)
        if width == 0 or v.numel() == 0:
            return
        self._fields.append((v, width))
        self.nbits += v.numel() * width

    def add_float(self, values: torch.Tensor) -> None:
        """Append floats as their IEEE bit patterns (32 or 64 bits each)."""
        words = _float_words(values.to(self.device))
        if len(words) == 1:
            self.add(words[0], 32)
        else:  # float64: low word then high word, value by value
            self.add(torch.stack(words, dim=-1).reshape(-1), 32)

    def to_bytes(self) -> torch.Tensor:
        nbytes = (self.nbits + 7) // 8
        bits = torch.zeros(nbytes * 8, dtype=torch.uint8, device=self.device)
        pos = 0
        for v, width in self._fields:
            n = v.numel()
            block = bits[pos : pos + n * width].view(n, width)
            for b in range(width):
                block[:, b] = ((v >> b) & 1).to(torch.uint8)
            pos += n * width
        grid = bits.view(nbytes, 8)
        out = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        for b in range(8):
            out |= grid[:, b] << b
        return out


class BitReader:
    """Reads back the fields a :class:`BitWriter` wrote, in the same order."""

    def __init__(self, payload: torch.Tensor) -> None:
        if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8:
            raise TypeError("a payload is a uint8 tensor as returned by encode()")
        p = payload.reshape(-1)
        shifts = torch.arange(8, device=p.device, dtype=torch.uint8)
        self._bits = ((p[:, None] >> shifts) & 1).reshape(-1)
        self.pos = 0

    @property
    def device(self) -> torch.device:
        return self._bits.device

    def read(self, count: int, width: int) -> torch.Tensor:
        """The next ``count`` fields of ``width`` bits as ``int64``."""
        if width == 0 or count == 0:
            return torch.zeros(count, dtype=torch.int64, device=self.device)
        end = self.pos + count * width
        if end > self._bits.numel():
            raise ValueError(
                f"payload too short: needs at least {(end + 7) // 8} bytes, has "
                f"{self._bits.numel() // 8}; was it encoded with the same compressor and d?"
            )
        block = self._bits[self.pos : end].view(count, width)
        self.pos = end
        out = torch.zeros(count, dtype=torch.int64, device=self.device)
        for b in range(width):
            out |= block[:, b].to(torch.int64) << b
        return out

    def read_float(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        """The next ``count`` floats of ``dtype``."""
        if dtype == torch.float32:
            w = self.read(count, 32)
            w = torch.where(w >= 1 << 31, w - (1 << 32), w)
            return w.to(torch.int32).view(torch.float32)
        if dtype == torch.float64:
            w = self.read(2 * count, 32).view(count, 2)
            hi = w[:, 1]
            hi = torch.where(hi >= 1 << 31, hi - (1 << 32), hi)
            return (hi * (1 << 32) + w[:, 0]).view(torch.float64)
        raise TypeError(f"the wire format carries float32 or float64 values, got {dtype}")
