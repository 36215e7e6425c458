"""Synthetic heterogeneous least squares with a prescribed spread of the clients' L_i.

The experiment knob of [EFR] Fig. 3 ("synthetic nonconvex linear regression", n = 2000 clients,
L_var from ≈ 5·10³ to ≈ 4·10⁶). The paper's generator is not published (methods.md §5); this one
is documented here and in docs/problems.md.

Construction (all draws keyed by ``seed``, streams ``"synthetic"``, ``"synthetic_x"``,
``"synthetic_noise"``; client i's data depend only on its own key):

1. Target constants: L_i = L_min + Δ t_i^q with t_i = i/(n − 1) (a fixed profile; q = ``shape``,
   larger q = a few clients with a much larger L_i), and Δ = √(L_var / Var(t^q)) so that the
   variance (1/n) Σ (L_i − L_AM)² equals ``L_var`` exactly; or explicit ``L_i``.
2. Client i's rows A_i = s_i G_i with G_i an m × d standard Gaussian matrix and
   s_i² = (L_i − c_R λ) m / (2 λ_max(G_iᵀG_i)), so that 2 λ_max(A_iᵀA_i)/m + c_R λ = L_i.
3. Targets b_i = A_i x_true + σ ε_i with x_true, ε_i standard Gaussian, σ = ``noise``.

The problem is then the :class:`~shrinkgrad.problems.linear.LinearModelProblem` with the squared
loss, f_i(x) = (1/m)‖A_i x − b_i‖² + λR(x): its L_i, L, μ, x*, f* are computed from the data
exactly as for real datasets (so the requested L_var is met up to rounding), and with λ = 0 or
``reg="l2"`` x*, f* and μ are exact. Generation is vectorised over blocks of clients (no
per-client Python objects, memory of the order of the data): n = 2000 clients take well under
a second, n = 10⁵ at d = 100, m = 10 a few tens of seconds (benchmarks/simulator.py scale).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from ..rng import Keys
from .base import PROBLEMS
from .linear import REG_CURVATURE, LinearModelProblem, Regularizer, Storage
from .memory import check_memory
from .smoothness import client_lambda_max
from .splits import ClientRows

#: keyed normals generated at once (memory of the generator's temporaries: ~10 × 8 bytes each)
_BLOCK = 1 << 21

__all__ = ["synthetic_L_i", "synthetic_least_squares"]


def synthetic_L_i(
    n_clients: int, L_var: float, L_min: float = 1.0, shape: float = 20.0
) -> np.ndarray:
    """The target profile L_i = L_min + Δ t_i^shape with variance exactly ``L_var`` (see above)."""
    if isinstance(n_clients, bool) or not isinstance(n_clients, int) or n_clients < 1:
        raise ValueError(f"n_clients must be a positive integer, got {n_clients!r}")
    if not (math.isfinite(L_var) and L_var >= 0):
        raise ValueError(f"L_var must be a finite number ≥ 0, got {L_var}")
    if not (math.isfinite(L_min) and L_min > 0):
        raise ValueError(f"L_min must be a finite number > 0, got {L_min}")
    if not (math.isfinite(shape) and shape > 0):
        raise ValueError(f"shape must be a finite number > 0, got {shape}")
    if n_clients == 1:
        if L_var > 0:
            raise ValueError("one client has L_var = 0; ask for L_var=0 or more clients")
        return np.array([L_min])
    t = np.linspace(0.0, 1.0, n_clients) ** shape
    var = float(((t - t.mean()) ** 2).mean())
    return L_min + math.sqrt(L_var / var) * t


def _normal(keys: Keys, count: int) -> np.ndarray:
    from scipy.special import ndtri

    return np.asarray(ndtri(keys.uniform(count).numpy()))


@PROBLEMS.register("synthetic_least_squares")
def synthetic_least_squares(
    n_clients: int = 2000,
    d: int = 20,
    m: int = 20,
    L_var: float = 1e4,
    L_min: float = 1.0,
    shape: float = 20.0,
    noise: float = 0.1,
    lam: float = 0.0,
    reg: Regularizer = "nonconvex",
    seed: int = 0,
    dtype: str | torch.dtype = "float64",
    device: str | torch.device | None = "cpu",
    storage: Storage = "dense",
    L_i: Sequence[float] | np.ndarray | None = None,
) -> LinearModelProblem:
    """Heterogeneous least squares with L_var (or the L_i) prescribed (see the module docstring).

    ``lam > 0`` adds λR(x) (nonconvex by default: the "synthetic nonconvex linear regression" of
    [EFR] Fig. 3); then x*, f* and μ are unknown. ``L_i`` (a vector of length n_clients)
    replaces the profile given by ``L_var``, ``L_min`` and ``shape``.
    """
    for name, v in (("d", d), ("m", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not (math.isfinite(noise) and noise >= 0):
        raise ValueError(f"noise must be a finite number ≥ 0, got {noise}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer ≥ 0, got {seed!r}")
    if isinstance(n_clients, bool) or not isinstance(n_clients, int) or n_clients < 1:
        raise ValueError(f"n_clients must be a positive integer, got {n_clients!r}")
    # refuse in one line, before allocating, data that cannot fit: the n·m × d float64 matrix A
    # (a lower bound on what the problem holds; problems.memory, as the dataset loader)
    check_memory(
        8.0 * n_clients * m * d,
        f"synthetic_least_squares with n_clients = {n_clients:,}, m = {m:,}, d = {d:,} (its "
        f"n_clients·m × d float64 data matrix)",
        "use fewer clients, samples per client (m) or dimensions (d)",
    )
    if L_i is not None:
        target = np.asarray(L_i, dtype=np.float64).reshape(-1)
        if target.size != n_clients:
            raise ValueError(f"L_i has {target.size} values but n_clients={n_clients}")
        if not np.all(np.isfinite(target)) or np.any(target <= 0):
            raise ValueError("the target L_i must be finite and > 0")
    else:
        target = synthetic_L_i(n_clients, L_var, L_min, shape)
    c_reg = REG_CURVATURE.get(reg, 0.0) * lam if lam > 0 else 0.0
    data_part = target - c_reg
    if np.any(data_part <= 0):
        raise ValueError(
            f"every target L_i must exceed the regularizer's curvature {c_reg:g} "
            f"({REG_CURVATURE.get(reg, 0.0):g}·lam); raise L_min or lower lam"
        )
    n = n_clients
    clients = np.arange(n)
    # generated block by block of clients (each client's draws depend on its own key only), in
    # place: the memory is the data itself, whatever n (10⁵ clients × m × d)
    A = np.empty((n * m, d))
    block = max(1, _BLOCK // (m * d))
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        keys = Keys.derive(seed, client=clients[lo:hi], stream="synthetic")
        A[lo * m : hi * m] = _normal(keys, m * d).reshape(-1, d)
    offsets = np.arange(n + 1, dtype=np.int64) * m
    lam_G = client_lambda_max(A, offsets)
    if np.any(lam_G <= 0):  # pragma: no cover - a Gaussian block is non-zero almost surely
        raise ValueError("a client's random data block is zero; change the seed")
    scale = np.sqrt(data_part * m / (2.0 * lam_G))
    A *= np.repeat(scale, m)[:, None]
    x_true = _normal(Keys.derive(seed, stream="synthetic_x"), d)
    eps = _normal(Keys.derive(seed, client=clients, stream="synthetic_noise"), m).reshape(-1)
    b = A @ x_true + noise * eps
    parts = ClientRows(np.arange(n * m, dtype=np.int64), offsets)
    problem = LinearModelProblem(
        A,
        b,
        parts,
        loss="squared",
        lam=lam,
        reg=reg,
        dtype=dtype,
        device=device,
        storage=storage,
        name="synthetic_least_squares" + ("" if lam == 0 else f"_{reg}"),
        dataset="synthetic",
        split="synthetic",
    )
    problem.x_true = torch.from_numpy(x_true)  # type: ignore[attr-defined]
    return problem
