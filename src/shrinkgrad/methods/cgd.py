"""Compressed gradient descent with a biased compressor and no error feedback (what EF fixes).

``cgd``: client i sends C(∇f_i(x^t)) with a contractive (biased) compressor such as Top-k, the
server steps x^{t+1} = x^t − γ (1/n) Σ_i C(∇f_i(x^t)). It is DCGD's step ([K18]) with a
compressor DCGD does not accept: without unbiasedness nothing makes the average of the
compressed gradients point downhill on average, and it can stall or diverge with n ≥ 2 clients
(Beznosikov, Horváth, Richtárik, Safaryan 2020, "On biased compression for distributed
learning", Example 1; [EF21] §1 motivates error feedback with it). It exists as the "no feedback"
baseline of comparisons such as the ``deep-ef`` reproduction: the identity compressor makes it
GD. No theory step size: pass a number.
"""

from __future__ import annotations

from typing import ClassVar

from .base import METHODS, Config, Requirement, Runtime
from .gd import DCGD

__all__ = ["CGD"]


@METHODS.register("cgd")
class CGD(DCGD):
    """x ← x − γ (1/n) Σ_i C(∇f_i(x)) with a biased compressor and no error feedback."""

    requires: ClassVar[Requirement] = "contractive"

    def theory_formula(self) -> str:
        return "none (no convergence guarantee with biased compressors): pass a number"

    def theory_stepsize(self, cfg: Config) -> tuple[float, str]:
        raise ValueError(
            "cgd (compressed GD without error feedback) has no theory step size: with a biased "
            "compressor it is not guaranteed to converge; pass a number, or use ef21"
        )

    def unsupported(self, runtime: Runtime) -> str | None:
        if runtime == "ps":  # DCGD's asynchronous rule is for unbiased compressors ([K18])
            return (
                "cgd is the no-feedback baseline for biased compressors; the asynchronous server's "
                "delay rule ([K18]) is for unbiased ones (use dcgd)"
            )
        return super().unsupported(runtime)
