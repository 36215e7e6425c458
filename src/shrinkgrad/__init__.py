"""shrinkgrad: communication-compressed distributed optimization.

Faithful implementations of distributed gradient methods with unbiased quantizers and stale
gradients (Khirirat, Feyzmahdavian, Johansson 2018) and of EF21 / EF21-W with contractive
compressors (Richtárik, Gasanov, Burlachenko, ICLR 2024), with theory-exact step sizes and honest
bit counts, as a vectorised simulator, a CLI and torch.distributed training.
"""

from __future__ import annotations

from .compressors import COMPRESSORS, Compressor, make_compressor
from .registry import Registry, SpecError, parse_spec
from .rng import Keys, KeyStream

__version__ = "0.1.0"

__all__ = [
    "COMPRESSORS",
    "Compressor",
    "KeyStream",
    "Keys",
    "Registry",
    "SpecError",
    "__version__",
    "make_compressor",
    "parse_spec",
]
