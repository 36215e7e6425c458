"""Identity and Top-k: the two deterministic compressors every method's exact tests rely on."""

from __future__ import annotations

import torch

from ..rng import Keys
from .base import COMPRESSORS, Compressor, _log2ceil


@COMPRESSORS.register("identity")
class Identity(Compressor):
    """C(x) = x: ω = 0, α = 1, 32·d bits. Turns every method into its uncompressed parent."""

    kind = "unbiased"
    deterministic = True
    positively_homogeneous = True
    collective = "allreduce"
    constant_formula = "ω = 0 (α = 1)"
    bits_formula = "32·d"

    def omega(self, d: int) -> float:
        return 0.0

    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(d * torch.finfo(dtype).bits)

    def paper_bits(self, d: int) -> float:
        return 32.0 * d

    def _apply(self, x: torch.Tensor, keys: Keys | None) -> torch.Tensor:
        return x.clone()


@COMPRESSORS.register("top_k")
class TopK(Compressor):
    """Top-k ([EF21] Def. 1 example): keep the k entries of largest |x_j|, zero the rest.

    Contractive with α = k/d, deterministic and positively homogeneous; ties are broken towards
    the lower index. Message: k values and k indices of ⌈log₂ d⌉ bits.
    """

    kind = "contractive"
    deterministic = True
    positively_homogeneous = True
    collective = "allgather"
    constant_formula = "α = k/d"
    bits_formula = "k·(32 + ⌈log₂ d⌉)"

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"top_k needs k >= 1 (the number of kept coordinates), got k={k}")
        self.k = k

    def _k(self, d: int) -> int:
        if self.k > d:
            raise ValueError(f"top_k[k={self.k}] cannot keep more than d={d} coordinates; use k <= {d}")
        return self.k

    def alpha(self, d: int) -> float:
        return self._k(d) / d

    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(self._k(d) * (torch.finfo(dtype).bits + _log2ceil(d)))

    def paper_bits(self, d: int) -> float:
        return 32.0 * self._k(d)

    def _apply(self, x: torch.Tensor, keys: Keys | None) -> torch.Tensor:
        k = self._k(x.shape[-1])
        idx = torch.topk(x.abs(), k, dim=-1, sorted=False).indices
        out = torch.zeros_like(x)
        return out.scatter_(-1, idx, x.gather(-1, idx))
