"""Compression operators with their constants (ω or α), bit counts and collectives.

Build any of them by name: ``make_compressor("qsgd[s=4]")``; list them with
``shrinkgrad list compressors``. See :mod:`shrinkgrad.compressors.base` for the contract and
``docs/compressors.md`` for every operator's definition, constant, bits and wire format.
"""

from . import basic, quantize, sparse, transforms
from .base import COMPRESSORS, Collective, Compressor, Kind, make_compressor
from .basic import Identity, TopK
from .quantize import QSGD, NaturalCompression, NaturalDithering, ScaledSign, Ternary
from .sparse import Bernoulli, RandK, RandKScaled
from .transforms import Compose, Scaled

__all__ = [
    "COMPRESSORS",
    "QSGD",
    "Bernoulli",
    "Collective",
    "Compose",
    "Compressor",
    "Identity",
    "Kind",
    "NaturalCompression",
    "NaturalDithering",
    "RandK",
    "RandKScaled",
    "Scaled",
    "ScaledSign",
    "Ternary",
    "TopK",
    "basic",
    "make_compressor",
    "quantize",
    "sparse",
    "transforms",
]
