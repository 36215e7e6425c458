"""Compression operators with their constants (ω or α), bit counts and collectives.

Build any of them by name: ``make_compressor("qsgd[s=4]")``; list them with
``shrinkgrad list compressors``. See :mod:`shrinkgrad.compressors.base` for the contract.
"""

from . import basic
from .base import COMPRESSORS, Collective, Compressor, Kind, make_compressor

__all__ = ["COMPRESSORS", "Collective", "Compressor", "Kind", "basic", "make_compressor"]
