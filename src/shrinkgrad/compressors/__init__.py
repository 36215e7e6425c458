"""Compression operators with their constants (ω or α), bit counts and collectives.

Build any of them by name: ``make_compressor("qsgd[s=4]")``; list them with
``shrinkgrad list compressors``. See :mod:`shrinkgrad.compressors.base` for the contract and
``docs/compressors.md`` for every operator's definition, constant, bits and wire format.
"""

from . import basic, lowrank, quantize, sparse, transforms
from .base import (
    COMPRESSORS,
    Collective,
    Compressor,
    ConstantUnknownError,
    Kind,
    make_compressor,
)
from .basic import Identity, TopK
from .lowrank import FactorCollective, FactorStage, PowerSGD, RankK, matrix_shape
from .quantize import (
    QSGD,
    NaturalCompression,
    NaturalDithering,
    ScaledSign,
    StandardDithering,
    Ternary,
)
from .ratio import ratio_spec, with_k
from .sparse import Bernoulli, LazyBernoulli, RandK, RandKScaled, StratK
from .transforms import Compose, Scaled

__all__ = [
    "COMPRESSORS",
    "QSGD",
    "Bernoulli",
    "Collective",
    "Compose",
    "Compressor",
    "ConstantUnknownError",
    "FactorCollective",
    "FactorStage",
    "Identity",
    "Kind",
    "LazyBernoulli",
    "NaturalCompression",
    "NaturalDithering",
    "PowerSGD",
    "RandK",
    "RandKScaled",
    "RankK",
    "Scaled",
    "ScaledSign",
    "StandardDithering",
    "StratK",
    "Ternary",
    "TopK",
    "basic",
    "lowrank",
    "make_compressor",
    "matrix_shape",
    "quantize",
    "ratio",
    "ratio_spec",
    "sparse",
    "transforms",
    "with_k",
]
