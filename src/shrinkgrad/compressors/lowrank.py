"""Low-rank compressors: exact truncated SVD (``rank_k``) and PowerSGD (``power_sgd``).

Both act on a tensor viewed as a matrix M ∈ R^{m×n} and send two factors, r(m + n) values
instead of mn.

Matrix view (:func:`matrix_shape`)
    A parameter of shape (m, n₁, n₂, …) is the matrix (m, n₁n₂…), as torch's PowerSGD hook
    views it: ``C.for_shape(param.shape)`` returns the compressor bound to that view (the hook
    knows each parameter's shape), equivalently ``rows=m`` in the name
    (``rank_k[r=4,rows=64]``). A flat vector of length d without ``rows`` uses the most square
    view: n = ⌈√d⌉ columns and m = ⌈d/n⌉ rows (m ≤ n), filled row by row, the last
    m·n − d < n entries zero (padding); with ``rows=m`` the view is m × ⌈d/m⌉, padded the same
    way. The compressed vector is the first d entries of the compressed matrix. Padding does
    not weaken the constants: ‖C(x) − x‖² ≤ ‖C(M) − M‖² (the padded entries' residual is
    dropped) and ‖M‖ = ‖x‖.

``rank_k[r]``
    The best rank-r approximation M_r = U_r Σ_r V_rᵀ (Eckart–Young; FL_PyTorch's
    ``RANK_K_COMPRESSOR``): ‖M − M_r‖² = Σ_{j>r} σ_j² ≤ (1 − r/min(m, n))‖M‖², because the
    dropped σ_j² are the smallest min(m, n) − r of the min(m, n) squared singular values.
    Contractive with α = r/min(m, n), attained by matrices with equal singular values
    (orthogonal matrices). Deterministic. Message: U_rΣ_r (m × r) and V_rᵀ (r × n). Each client's
    factors are its own (the sum of n rank-r matrices has rank up to nr and the factors of
    different SVDs do not add), so its collective is an all-gather of the factors.

``power_sgd[rank]``
    PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019, Alg. 1): one power iteration from the
    previous Q: P = M Q, P̂ = orthonormalize(P) (QR, in float32 or finer), Q ← Mᵀ P̂, and
    C(M) = P̂ Qᵀ = P̂ P̂ᵀ M, the projection of M's columns on span(P̂). Hence
    ‖C(M) − M‖² = ‖M‖² − ‖P̂ᵀM‖² ≤ ‖M‖²: never an expansion, but **no worst-case α > 0**: when
    M Q = 0 (M's row space orthogonal to the previous Q) C(M) = 0, and the paper gives no
    constant. ``alpha(d)`` therefore raises :class:`~.base.ConstantUnknownError` and theory
    step sizes refuse, unless the user states one (``power_sgd[rank=4,alpha=0.1]``: a belief,
    not a bound; docs/compressors.md reports measured contractions). The previous Q is explicit
    state (:meth:`PowerSGD.init_state`, :meth:`PowerSGD.step`): EF21 and EF keep it in their
    client state. Its first Q is a keyed Gaussian draw.

    Collective: PowerSGD's all-reduce of the factors, described by
    :meth:`PowerSGD.factor_collective` (P (m × r) summed, then Q (n × r) summed) with the stage
    functions :meth:`~PowerSGD.left`, :meth:`~PowerSGD.orthonormalize`, :meth:`~PowerSGD.right`
    and :meth:`~PowerSGD.combine`. With a shared Q on every rank, the mean of the ranks'
    results is exactly ``step(mean M, Q)``: the operator applied to the average (tested). The
    simulator's clients each run the operator on their own matrix with their own Q.

``power_sgd[rank, shared=true]`` — the shared basis (PowerSGD as the paper runs it, and as the
DDP hook runs it)
    A **collective** compressor: the rows of one call are the clients of one all-reduce, and
    each client's output depends on the others'. For the rows M_1 … M_B of a call, with the
    one Q every client shares: P = Σ_i M_i Q, P̂ = orthonormalize(P), Q_i = M_iᵀ P̂, client
    i's output P̂ Q_iᵀ, and the next (shared) Q the mean Q̄ = (1/B) Σ_i Q_i, so the mean of the
    outputs is P̂ Q̄ᵀ. Per-client PowerSGD (the default) runs Alg. 1 on every row alone: its P̂
    is the client's own. Consequences: (i) there is no per-client α (client i's error depends on
    the other clients' matrices; none is known for the mean either), so ``alpha`` is unknown
    unless given; (ii) a call on a subset of the clients (partial participation) is a
    collective of that subset only, and a method whose clients would hold different Q's then
    is refused at the step; (iii) the first Q is one keyed draw shared by every client (a fixed
    key, like torch's ``random_seed``), so the compressor is deterministic; (iv) the message of
    every client is the two factors, r(m + n) values, whatever d (a shared P cannot be
    replaced by the dense result): P_i then Q_iᵀ, rounded to a 16-bit input's dtype; P̂ never
    travels (every client forms it from ΣP_i), so it is not rounded, and ``C(x)`` of 16-bit
    rows is ``step``'s first result (before, C(x) rounded P̂ instead of P_i and Q_i). The
    stages :meth:`PowerSGD.factor_p`, :meth:`PowerSGD.orthonormalize`,
    :meth:`PowerSGD.factor_q`, :meth:`PowerSGD.factor_outputs` are
    the one implementation: the batched step composes them with sums over the rows, the hook
    with its two all-reduces.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..rng import Keys
from . import _lowrank_kernels
from ._wire import HALF_DTYPES, BitReader, BitWriter, float_width, paper_width
from .base import (
    COMPRESSORS,
    Collective,
    Compressor,
    ConstantUnknownError,
    _check_positive_int,
    _require_finite,
    check_dimension,
)

__all__ = [
    "FactorCollective",
    "FactorStage",
    "LowRank",
    "PowerSGD",
    "RankK",
    "matrix_shape",
]

#: fold tag of PowerSGD's initial Q
Q0_TAG = "power_sgd.q0"
#: the key of the shared-basis mode's first Q (one draw for every client: ``shared=true``)
SHARED_Q0 = Keys.derive(0, stream="power_sgd.shared_q0")


def matrix_shape(d: int, rows: int | None = None) -> tuple[int, int]:
    """The matrix (m, n) a flat vector of length ``d`` is viewed as (module docstring): with
    ``rows``, m = rows and n = ⌈d/m⌉; otherwise n = ⌈√d⌉ and m = ⌈d/n⌉."""
    d = check_dimension(d, "matrix_shape(d)")
    if rows is None:
        n = math.isqrt(d)
        n += n * n < d
        return -(-d // n), n
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= d:
        raise ValueError(f"the matrix view needs rows in [1, d={d}], got {rows!r}")
    return rows, -(-d // rows)


class FactorStage(NamedTuple):
    """One collective of a factor exchange: ``name`` ("P", "Q"), its ``shape`` and how the
    ranks' contributions combine (``"sum"``: an all-reduce)."""

    name: str
    shape: tuple[int, int]
    reduce: str


class FactorCollective(NamedTuple):
    """How a low-rank compressor's messages travel: the matrix view, the rank, the stages in
    order and the bits one rank sends per step (the stages' values in the wire dtype)."""

    matrix: tuple[int, int]
    rank: int
    stages: tuple[FactorStage, ...]
    bits: float


def _gaussian(keys: Keys, count: int, dtype: torch.dtype) -> torch.Tensor:
    """Keyed standard normal draws (Box–Muller on the keyed uniforms), shape (*keys, count)."""
    u = keys.uniform(2 * count, torch.float64)
    z = torch.sqrt(-2.0 * torch.log(u[..., :count])) * torch.cos(2.0 * math.pi * u[..., count:])
    return z.to(dtype)


def _each(fn: Callable[..., Any], *batches: torch.Tensor) -> Any:
    """``fn`` applied to the matrices of the batches one at a time, on fresh contiguous copies,
    results stacked. Batched LAPACK/BLAS calls are not bit-reproducible across batch sizes (a
    batched SVD of 11 × 12 float32 matrices differs from single calls in the last bits: the
    libraries block and align batches differently), and the contract is that row i of a batch
    is exactly what a call on that row alone gives; so each row is its own call, at the cost of
    a Python-level loop over the rows (the simulator's clients), ~0.05 ms per small matrix."""
    rows = batches[0].shape[0]
    outs = [fn(*(_own_row(b, i) for b in batches)) for i in range(rows)]
    if rows == 1:  # one matrix (the hook's batches): a view, not a stacked copy of it
        if isinstance(outs[0], tuple):
            return tuple(o.unsqueeze(0) for o in outs[0])
        return outs[0].unsqueeze(0)
    if outs and isinstance(outs[0], tuple):
        return tuple(torch.stack(list(o)) for o in zip(*outs, strict=True))
    return torch.stack(outs)


def _own_row(b: torch.Tensor, i: int) -> torch.Tensor:
    """Row ``i`` of a batch as :func:`_each` hands it to the libraries: the row itself when it
    is contiguous and starts on a 64-byte boundary (the layout and alignment a fresh copy has:
    torch's CPU allocator aligns to 64 bytes, so the libraries take the same paths), else a
    contiguous copy (saves a copy of every large matrix, e.g. the hook's one-row batches)."""
    row = b[i]
    if row.is_contiguous() and row.data_ptr() % 64 == 0:
        return row
    return row.clone(memory_format=torch.contiguous_format)


def _outer(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """P Qᵀ for P (m, r), Q (n, r) (into ``out`` (m, n) when given): the numba kernel of
    :mod:`._lowrank_kernels` for float32 CPU tensors (BLAS's own fused multiply-add order, 2–3×
    faster for a small r), ``torch.mm`` otherwise."""
    if _lowrank_kernels.usable(p, q):
        if out is None:
            out = torch.empty(p.shape[0], q.shape[0], dtype=p.dtype)
        return _lowrank_kernels.product_into(p, q, out)
    return p.mm(q.t()) if out is None else torch.mm(p, q.t(), out=out)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The arithmetic dtype: float64 for float64 inputs, float32 otherwise (16-bit included)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_factors(c: LowRank, dtype: torch.dtype, *factors: torch.Tensor) -> None:
    """``c._overflow(dtype)`` unless every factor is finite (the input was checked finite, so
    an inf or NaN here is an overflow of ``dtype``'s range in the factors)."""
    if not all(bool(torch.isfinite(f).all()) for f in factors):
        raise c._overflow(dtype)


class LowRank(Compressor):
    """Shared machinery: the matrix view, the rank check, bits and the factor wire format."""

    kind = "contractive"
    collective: Collective = "allgather"
    positively_homogeneous = True
    bits_formula = "32·min(r·(m + n), d) (m × n: the matrix view; d values when smaller)"
    _family = "low_rank"

    def __init__(self, r: int, rows: int | None = None) -> None:
        self.r = _check_positive_int(r, "the rank", self._family)
        if rows is not None:
            self.rows: int | None = _check_positive_int(
                rows, "rows (the matrix view)", self._family
            )
        else:
            self.rows = None

    # -- the matrix view ----------------------------------------------------------------------
    def matrix_shape(self, d: int) -> tuple[int, int]:
        """The (m, n) view of a vector of length d (module docstring); the rank must fit it."""
        d = check_dimension(d, f"{self.name}.matrix_shape(d)")
        if self.rows is not None and self.rows > d:
            raise ValueError(f"{self.name}: rows={self.rows} exceeds the vector length d={d}")
        m, n = matrix_shape(d, self.rows)
        if self.r > min(m, n):
            raise ValueError(
                f"{self.name}: rank {self.r} exceeds min(m, n) = {min(m, n)} of the {m} × {n} "
                f"view of d={d}; use a rank in [1, {min(m, n)}]"
            )
        return m, n

    def for_shape(self, shape: tuple[int, ...] | torch.Size) -> LowRank:
        """This compressor bound to the matrix view of a tensor of ``shape``: (shape[0],
        prod(shape[1:])) for tensors of two or more dimensions, the flat rule otherwise."""
        dims = tuple(int(s) for s in shape)
        rows = dims[0] if len(dims) >= 2 else None
        if rows == self.rows:
            return self
        params = self._params()
        params["rows"] = rows
        text = ",".join(f"{k}={v}" for k, v in params.items() if v is not None)
        built = COMPRESSORS.make(f"{self.spec.split('[')[0] or self._family}[{text}]")
        assert isinstance(built, LowRank)
        return built

    def _params(self) -> dict[str, object]:
        return {"r": self.r, "rows": self.rows}

    def _matrices(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int, int]:
        """x (..., d) as a batch of matrices (B, m, n) in ``dtype`` (zero padded)."""
        d = x.shape[-1]
        m, n = self.matrix_shape(d)
        flat = x.reshape(-1, d).to(dtype)
        if m * n != d:
            flat = torch.nn.functional.pad(flat, (0, m * n - d))
        return flat.reshape(-1, m, n), m, n

    @staticmethod
    def _vectors(M: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        d = shape[-1]
        return M.reshape(M.shape[0], -1)[:, :d].reshape(shape)

    # -- bits ---------------------------------------------------------------------------------
    def dense_message(self, d: int) -> bool:
        """True when the factors would not be shorter than the vector (r(m + n) ≥ d): the
        message then carries the d values of C(x) instead (never more than the vector)."""
        m, n = self.matrix_shape(d)
        return self.r * (m + n) >= d

    def _values_sent(self, d: int) -> int:
        m, n = self.matrix_shape(d)
        return min(self.r * (m + n), d)

    def bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(float_width(dtype) * self._values_sent(d))

    def paper_bits(self, d: int, dtype: torch.dtype = torch.float32) -> float:
        return float(paper_width(dtype) * self._values_sent(d))

    # -- the message: two factors, A (m × r) and B (r × n), C(M) = A B ------------------------
    def _factors(
        self, x: torch.Tensor, keys: Keys | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The factors (B, m, r), (B, r, n) of every row of validated input, in ``dtype``."""
        raise NotImplementedError

    @staticmethod
    def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """A B for batches (B, m, r) @ (B, r, n), one matrix at a time (:func:`_each`), used by
        every path (the receiver included), so that decode(encode(x)) equals C(x) bit for bit."""
        return _each(torch.mm, a, b)  # type: ignore[no-any-return]

    #: the factors a message carries, as the overflow error names them
    _factor_names = "U_rΣ_r and V_rᵀ"

    def _finite_factors(
        self, x: torch.Tensor, keys: Keys | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_factors`, or a ValueError when one leaves ``dtype``'s range (a finite input
        whose singular values or norms overflow, e.g. float32 entries near 3.4e38)."""
        a, b = self._factors(x, keys, dtype)
        _check_factors(self, dtype, a, b)
        return a, b

    def _half_factors(
        self, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 factors ``a``, ``b`` rounded to the 16-bit ``dtype`` they travel in
        (returned as float32), or the factor-overflow ValueError (:meth:`_overflow`) when one
        leaves that dtype's range: a float16 factor overflows for matrices whose singular
        values exceed 65504 although every entry (and C(x)) is finite."""
        a, b = a.to(dtype), b.to(dtype)
        _check_factors(self, dtype, a, b)
        return a.float(), b.float()

    def _overflow(self, dtype: torch.dtype) -> ValueError:
        """The error of a finite input whose factors leave ``dtype``'s range (the dtype the
        factors are computed or sent in). The factors scale with the singular values of the
        matrix view (up to ‖M‖, √(mn) times its largest entry), not with its entries, so they
        can overflow where the input and C(x) do not (Vogels et al. 2019 send them in the
        gradients' dtype)."""
        if dtype == torch.float16:
            fix = (
                "compress bfloat16 tensors (float32's range) or float32 ones, or rescale the "
                "input (e.g. a smaller loss scale)"
            )
        else:
            fix = "rescale the input or compress float64 tensors"
        return ValueError(
            f"{self.name}: a low-rank factor ({self._factor_names}) of the matrix view "
            f"overflows {dtype}'s range (±{torch.finfo(dtype).max:.6g}) although the input is "
            f"finite: the factors grow with the matrix's singular values, not its entries; {fix}"
        )

    def _apply(self, x: torch.Tensor, keys: Keys | None, out: torch.Tensor | None) -> torch.Tensor:
        _require_finite(x, self.name)
        if x.numel() == 0:
            return x.clone() if out is None else out
        a, b = self._finite_factors(x, keys, x.dtype)
        y = self._vectors(self._product(a, b), x.shape)
        return y if out is None else out.copy_(y)

    def _apply_half(self, x: torch.Tensor, keys: Keys | None, dtype: torch.dtype) -> torch.Tensor:
        """16-bit inputs: the factors in float32, rounded to the 16-bit dtype they travel in,
        multiplied in float32 (the caller rounds the product once)."""
        _require_finite(x, self.name)
        if x.numel() == 0:
            return x.clone()
        a, b = self._finite_factors(x, keys, torch.float32)
        a, b = self._half_factors(a, b, dtype)
        return self._vectors(self._product(a, b), x.shape)

    def _encode_fields(self, w: BitWriter, x: torch.Tensor, keys: Keys | None) -> None:
        _require_finite(x, self.name)
        if self.dense_message(x.shape[-1]):  # the values of C(x): shorter than the factors
            vd = w.value_dtype
            w.add_values(
                self._apply(x, keys, None) if vd is None else self._apply_half(x, keys, vd)
            )
            return
        a, b = self._finite_factors(x, keys, x.dtype)
        if w.value_dtype is not None:  # (add_values would name the values, not the factors)
            self._half_factors(a, b, w.value_dtype)
        w.add_values(a.reshape(-1))
        w.add_values(b.reshape(-1))

    def _decode_fields(
        self,
        r: BitReader,
        d: int,
        dtype: torch.dtype,
        keys: Keys | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.dense_message(d):
            return r.read_values(d, dtype, out)
        m, n = self.matrix_shape(d)
        a = r.read_values(m * self.r, dtype).reshape(1, m, self.r)
        b = r.read_values(self.r * n, dtype).reshape(1, self.r, n)
        return self._vectors(self._product(a, b), torch.Size([d]))


@COMPRESSORS.register("rank_k")
class RankK(LowRank):
    """Rank-r truncated SVD of the matrix view (FL_PyTorch's ``rank_k``; Eckart–Young):
    contractive with α = r/min(m, n), exact for matrices with equal singular values; message
    U_rΣ_r (m × r) and V_rᵀ (r × n). See :mod:`shrinkgrad.compressors.lowrank`."""

    deterministic = True
    constant_formula = "α = r/min(m, n)  (m × n: the matrix view)"
    _family = "rank_k"

    def __init__(self, r: int, rows: int | None = None) -> None:
        super().__init__(r, rows)

    def alpha(self, d: int) -> float:
        m, n = self.matrix_shape(d)
        return self.r / min(m, n)

    def _apply(self, x: torch.Tensor, keys: Keys | None, out: torch.Tensor | None) -> torch.Tensor:
        m, n = self.matrix_shape(x.shape[-1])
        if self.r == min(m, n):  # full rank: M_r = M exactly (no SVD round-off)
            _require_finite(x, self.name)
            return x.clone() if out is None else out.copy_(x)
        return super()._apply(x, keys, out)

    def _apply_half(self, x: torch.Tensor, keys: Keys | None, dtype: torch.dtype) -> torch.Tensor:
        m, n = self.matrix_shape(x.shape[-1])
        if self.r == min(m, n):
            _require_finite(x, self.name)
            return x
        return super()._apply_half(x, keys, dtype)

    def _factors(
        self, x: torch.Tensor, keys: Keys | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        M, _, _ = self._matrices(x, _compute_dtype(dtype))
        r = self.r

        def truncated(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            u, sv, vh = torch.linalg.svd(m, full_matrices=False)
            return (u[:, :r] * sv[:r]).to(dtype), vh[:r].to(dtype)

        return _each(truncated, M)  # type: ignore[no-any-return]


@COMPRESSORS.register("power_sgd")
class PowerSGD(LowRank):
    """PowerSGD's rank-r approximation (Vogels, Karimireddy, Jaggi 2019, Alg. 1): one power
    iteration from the previous Q, orthonormalization in float32 (float64 for float64 input).

    Contractive only in the weak sense ‖C(M) − M‖ ≤ ‖M‖: no worst-case α exists (module
    docstring), so ``alpha`` is unknown unless given (``alpha=...``). Stateful: the state of a
    row is its Q (n × r); ``C(x, keys)`` is the first step from the keyed initial Q.
    """

    deterministic = False
    stateful = True
    collective = "allreduce_factors"
    constant_formula = "none: no worst-case α (give alpha=... for theory step sizes)"
    bits_formula = (
        "32·min(rank·(m + n), d); shared=true: 32·rank·(m + n), P (m × rank) then Q (n × rank), "
        "each all-reduced"
    )
    _family = "power_sgd"
    _factor_names = "P = MQ, Q = MᵀP̂"

    def __init__(
        self,
        rank: int,
        alpha: float | None = None,
        rows: int | None = None,
        shared: bool = False,
    ) -> None:
        super().__init__(rank, rows)
        if alpha is not None:
            if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
                raise TypeError(f"power_sgd needs a number alpha, got {alpha!r}")
            if not 0.0 < float(alpha) <= 1.0:
                raise ValueError(f"power_sgd needs alpha in (0, 1] (a contraction), got {alpha}")
        if not isinstance(shared, bool):
            raise TypeError(f"power_sgd needs shared=true or shared=false, got {shared!r}")
        self.given_alpha = None if alpha is None else float(alpha)
        self.constant_known = alpha is not None
        #: the shared-basis (collective) mode: one P̂ for all the rows of a call (module
        #: docstring); its first Q is one fixed draw, so it is deterministic
        self.shared = shared
        self.deterministic = shared

    def _params(self) -> dict[str, object]:
        params: dict[str, object] = {"rank": self.r, "alpha": self.given_alpha, "rows": self.rows}
        if self.shared:
            params["shared"] = "true"
        return params

    @property
    def collective_rows(self) -> bool:
        """True when the rows of one call are the clients of one collective (``shared``)."""
        return self.shared

    def dense_message(self, d: int) -> bool:
        """Per-client: as :meth:`LowRank.dense_message`; shared: never (the factors are the
        message, r(m + n) values, since P̂ is formed from every client's P)."""
        return False if self.shared else super().dense_message(d)

    def _values_sent(self, d: int) -> int:
        if not self.shared:
            return super()._values_sent(d)
        m, n = self.matrix_shape(d)
        return self.r * (m + n)

    def alpha(self, d: int) -> float:
        self.matrix_shape(d)
        if self.given_alpha is None:
            raise ConstantUnknownError(
                f"{self.name} has no worst-case α (Vogels et al. 2019 give none: one power "
                "iteration can miss M's top directions, and C(M) = 0 when M Q = 0"
                + ("; shared: a client's result also depends on the others'" if self.shared else "")
                + "); a theory step "
                f"size needs one: give it explicitly, e.g. power_sgd[rank={self.r}"
                + (",shared=true" if self.shared else "")
                + ",alpha=0.1] "
                "(docs/compressors.md reports measured contractions), or pass a numeric step size"
            )
        return self.given_alpha

    # -- state --------------------------------------------------------------------------------
    def init_state(self, x: torch.Tensor, keys: Keys | None) -> torch.Tensor:
        """The first Q of every row of ``x`` (..., d): keyed Gaussian draws, (..., n, r), in the
        arithmetic dtype (float32, or float64 for float64 input); ``shared``: one fixed draw
        repeated on every row."""
        self._check_input(x)
        _, n = self.matrix_shape(x.shape[-1])
        if self.shared:  # one draw, the same for every client (``keys`` are not used)
            q = _gaussian(SHARED_Q0.fold(Q0_TAG), n * self.r, _compute_dtype(x.dtype))
            q = q.reshape(n, self.r).expand(*x.shape[:-1], n, self.r).clone()
            return q.to(x.device)
        row_keys = self._prepare_keys(x, keys)
        assert row_keys is not None
        q = _gaussian(row_keys.fold(Q0_TAG), n * self.r, _compute_dtype(x.dtype))
        return q.reshape(*x.shape[:-1], n, self.r).to(x.device)

    def check_state(self, x: torch.Tensor, state: torch.Tensor) -> None:
        """A ValueError unless ``state`` is a Q for every row of ``x``."""
        _, n = self.matrix_shape(x.shape[-1])
        want = (*x.shape[:-1], n, self.r)
        if not isinstance(state, torch.Tensor) or tuple(state.shape) != want:
            got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
            raise ValueError(f"{self.name}: the state must be Q of shape {want}, got {got}")
        if state.dtype != _compute_dtype(x.dtype):
            raise ValueError(
                f"{self.name}: the state Q must be {_compute_dtype(x.dtype)} for {x.dtype} input"
            )

    def step(
        self, x: torch.Tensor, keys: Keys | None, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One PowerSGD step of every row with its previous Q: ``(C(x), new Q)``; ``shared``:
        one collective step of all the rows (:meth:`_shared_step`)."""
        self._check_input(x)
        keys = self._prepare_keys(x, keys)
        self.check_state(x, state)
        _require_finite(x, self.name)
        value_dtype = x.dtype if x.dtype in HALF_DTYPES else None
        if x.numel() == 0:
            return x.clone(), state.clone()
        if self.shared:
            return self._shared_step(x, state)
        M, _, n = self._matrices(x, _compute_dtype(x.dtype))
        p_hat, q = self._power_step(M, state.reshape(-1, n, self.r))
        _check_factors(self, M.dtype, p_hat, q)  # never an inf/NaN C(x) or next Q
        a, b = p_hat, q.transpose(-1, -2)
        if value_dtype is not None:
            a, b = self._half_factors(a, b, value_dtype)
        y = self._vectors(self._product(a, b), x.shape)
        if value_dtype is not None:
            y = self._to_half(y, value_dtype)
        elif y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y, q.reshape(state.shape)

    # -- the stages (shared by the per-client step and the hook's factor all-reduce) ----------
    @staticmethod
    def left(M: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """P = M Q: (B, m, n) @ (B, n, r); summed over ranks by the first all-reduce."""
        return _each(torch.mm, M, q)  # type: ignore[no-any-return]

    @staticmethod
    def orthonormalize(p: torch.Tensor) -> torch.Tensor:
        """P̂ (B, m, r) with orthonormal columns spanning P's (reduced QR, Householder, in at
        least float32 arithmetic; a rank-deficient P still gives orthonormal columns, never
        NaN)."""

        def qr(a: torch.Tensor) -> torch.Tensor:
            work = a if a.dtype == torch.float64 else a.to(torch.float32)
            basis: torch.Tensor = torch.linalg.qr(work, mode="reduced").Q
            return basis.to(a.dtype)

        return _each(qr, p)  # type: ignore[no-any-return]

    @staticmethod
    def right(M: torch.Tensor, p_hat: torch.Tensor) -> torch.Tensor:
        """Q = Mᵀ P̂: (B, n, r); summed over ranks by the second all-reduce. Computed as
        (P̂ᵀ M)ᵀ, which reads M row by row (5× faster than Mᵀ P̂ for a 2048 × 2048 M)."""
        return _each(lambda m, p: p.t().mm(m).t(), M, p_hat)  # type: ignore[no-any-return]

    @staticmethod
    def combine(p_hat: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """The decompressed matrix P̂ Qᵀ (B, m, n) (:func:`_outer`)."""
        return _each(_outer, p_hat, q)  # type: ignore[no-any-return]

    def _power_step(self, M: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p_hat = self.orthonormalize(self.left(M, q.to(M.dtype)))
        return p_hat, self.right(M, p_hat)

    # -- the shared basis: the stages of one collective step (module docstring) ---------------
    def _value_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        return dtype if dtype in HALF_DTYPES else None

    def factor_p(self, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Every row's P_i = M_i Q (B, m, r) for rows ``x`` (B, d) and the shared Q (n, r), in
        the arithmetic dtype, rounded to the values' 16-bit dtype when ``x`` is one (the wire
        carries P_i in the gradients' dtype)."""
        M, _, _ = self._matrices(x, _compute_dtype(x.dtype))
        p = self.left(M, q.to(M.dtype).expand(M.shape[0], *q.shape))
        vd = self._value_dtype(x.dtype)
        return p if vd is None else p.to(vd).to(p.dtype)

    def factor_q(self, x: torch.Tensor, p_hat: torch.Tensor) -> torch.Tensor:
        """Every row's Q_i = M_iᵀ P̂ (B, n, r) for the shared P̂ (m, r), rounded like
        :meth:`factor_p`."""
        M, _, _ = self._matrices(x, _compute_dtype(x.dtype))
        q = self.right(M, p_hat.to(M.dtype).expand(M.shape[0], *p_hat.shape))
        vd = self._value_dtype(x.dtype)
        return q if vd is None else q.to(vd).to(q.dtype)

    def orthonormal_basis(self, p_sum: torch.Tensor) -> torch.Tensor:
        """P̂ (m, r) of the summed P (m, r): :meth:`orthonormalize` in at least float32."""
        work = p_sum if p_sum.dtype == torch.float64 else p_sum.to(torch.float32)
        return self.orthonormalize(work[None])[0]

    def factor_outputs(
        self,
        p_hat: torch.Tensor,
        q: torch.Tensor,
        d: int,
        dtype: torch.dtype,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The vectors P̂ Q_iᵀ (B, d) in ``dtype`` of the rows' Q_i (B, n, r) (or of the mean
        Q̄ (1, n, r): the mean of the clients' outputs). ``out`` (d entries, contiguous, for
        one row): where the product is written when the matrix view has no padding (m n = d)
        and ``dtype`` is the arithmetic dtype, by the same ``mm`` as :meth:`combine` (the same
        bits), without a temporary; it is returned as (1, d). Otherwise the result is copied
        into ``out``."""
        m, n = p_hat.shape[-2], q.shape[-2]
        if (
            out is not None
            and q.shape[0] == 1
            and m * n == d
            and dtype == p_hat.dtype
            and out.is_contiguous()
            and out.dtype == dtype
        ):
            a, b = _own_row(p_hat[None], 0), _own_row(q.to(p_hat.dtype), 0)
            _outer(a, b, out.view(m, n))
            return out.view(1, d)
        prod = self.combine(p_hat.expand(q.shape[0], *p_hat.shape), q.to(p_hat.dtype))
        res = self._vectors(prod, torch.Size([q.shape[0], d])).to(dtype)
        return res if out is None else out.view(res.shape).copy_(res)

    def add_outputs(
        self, x: torch.Tensor, p_hat: torch.Tensor, q: torch.Tensor, alpha: float = 1.0
    ) -> None:
        """x ← x + α P̂ Qᵀ in place, for a flat contiguous x of m·n entries (no padding), P̂
        (m, r), Q (1, n, r) or (n, r), α = ±1: the bits of ``x ± factor_outputs(P̂, Q)``
        (the same product, then one addition per entry), in one pass over x where the
        product kernel applies (float32 CPU, :mod:`._lowrank_kernels`)."""
        m, r = p_hat.shape
        qq = q.reshape(-1, r).to(p_hat.dtype)
        n = qq.shape[0]
        if x.numel() != m * n or not x.is_contiguous() or x.dtype != p_hat.dtype:
            raise ValueError(
                f"{self.name}: add_outputs needs a contiguous {p_hat.dtype} vector of "
                f"{m}·{n} entries, got {tuple(x.shape)} {x.dtype}"
            )
        if alpha not in (1.0, -1.0):
            raise ValueError(f"{self.name}: add_outputs takes alpha = ±1, got {alpha}")
        a, b = _own_row(p_hat[None], 0), _own_row(qq[None], 0)
        if _lowrank_kernels.usable(a, b):
            _lowrank_kernels.add_product(a, b, x.view(m, n), alpha)
            return
        x.view(m, n).add_(_outer(a, b), alpha=alpha)

    def _shared_step(
        self, x: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One collective step of the rows of ``x`` (module docstring): P = Σ_i P_i, P̂, the
        rows' P̂ Q_iᵀ and the next shared Q = mean Q_i on every row."""
        d = x.shape[-1]
        rows = x.reshape(-1, d)
        _, n = self.matrix_shape(d)
        qs = state.reshape(-1, n, self.r)
        if not bool((qs == qs[:1]).all()):
            raise ValueError(
                f"{self.name}: the clients of one shared-basis step hold different Q's (a method "
                "whose clients skip rounds, partial participation, lets them drift apart); use "
                f"power_sgd[rank={self.r}] (per-client) with such a method"
            )
        _, p_hat, q_rows = self._shared_factors(rows, qs[0])
        y = self.factor_outputs(p_hat, q_rows, d, x.dtype).reshape(x.shape)
        if x.dtype in HALF_DTYPES:
            y = self._to_half(y.float(), x.dtype)
        q_mean = q_rows.mean(0).to(state.dtype)
        return y, q_mean.expand_as(qs).reshape(state.shape).clone()

    def factor_collective(self, d: int, dtype: torch.dtype = torch.float32) -> FactorCollective:
        """PowerSGD's all-reduce of the factors for a tensor of d entries (values in ``dtype``):
        P (m × r) summed over the ranks, P̂ = orthonormalize(P) on every rank, then
        Q_i = Mᵢᵀ P̂ (n × r) summed; the mean result is P̂ (ΣQ_i/n)ᵀ and the next state ΣQ_i/n
        (shared by all ranks). ``bits`` is what one rank sends: r(m + n) values (when that is
        not less than d, :meth:`dense_message`, a hook does better sending the tensor)."""
        m, n = self.matrix_shape(d)
        stages = (FactorStage("P", (m, self.r), "sum"), FactorStage("Q", (n, self.r), "sum"))
        bits = float(float_width(dtype) * self.r * (m + n))
        return FactorCollective((m, n), self.r, stages, bits)

    # -- the stateless contract: the first step from the keyed Q -------------------------------
    def _factors(
        self, x: torch.Tensor, keys: Keys | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.shared:  # the first collective step of all the rows, from the shared Q0
            _, p_hat, q = self._shared_first(x)
            B = q.shape[0]
            return p_hat.expand(B, *p_hat.shape).to(dtype), q.transpose(-1, -2).to(dtype)
        assert keys is not None
        M, _, n = self._matrices(x, _compute_dtype(dtype))
        q0 = _gaussian(keys.fold(Q0_TAG), n * self.r, M.dtype).reshape(-1, n, self.r)
        p_hat, q = self._power_step(M, q0.to(M.device))
        return p_hat.to(dtype), q.transpose(-1, -2).to(dtype)

    def _shared_q0(self, rows: torch.Tensor) -> torch.Tensor:
        """The shared first Q (n, r) for rows (B, d)."""
        return self.init_state(rows[:1], None)[0]

    def _shared_first(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first collective step of the rows of ``x`` (..., d) from the shared Q0, by the
        stages :meth:`step` composes (Vogels et al. 2019, Alg. 1): ``(P, P̂, Q_i)`` with
        P = Σ_i P_i (m, r), P̂ = orthonormalize(P) and the rows' Q_i (B, n, r), in the
        arithmetic dtype. A 16-bit ``x`` rounds P_i and Q_i to its dtype (they travel), not P̂
        (every client forms it from P; it never travels)."""
        rows = x.reshape(-1, x.shape[-1])
        return self._shared_factors(rows, self._shared_q0(rows))

    def _shared_factors(
        self, rows: torch.Tensor, q: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(P, P̂, Q_i)`` of one collective step of ``rows`` (B, d) from the shared ``q``
        (n, r): P = Σ_i P_i, P̂ = orthonormalize(P), Q_i = M_iᵀ P̂; the factor-overflow
        ValueError (:meth:`_overflow`, naming the dtype the factors travel in) when a P_i, P
        or Q_i is not finite, instead of an inf/NaN output and next Q. The dtype named is
        float16 for float16 rows (whose factors travel in float16), else the arithmetic's
        (bfloat16 has float32's range)."""
        dtype = torch.float16 if rows.dtype == torch.float16 else _compute_dtype(rows.dtype)
        p_rows = self.factor_p(rows, q)
        p_sum = p_rows.sum(0)
        _check_factors(self, dtype, p_rows, p_sum)
        p_hat = self.orthonormal_basis(p_sum)
        q_rows = self.factor_q(rows, p_hat)
        _check_factors(self, dtype, q_rows)
        return p_sum, p_hat, q_rows

    def _apply_half(self, x: torch.Tensor, keys: Keys | None, dtype: torch.dtype) -> torch.Tensor:
        """Per-client: :meth:`LowRank._apply_half` (both factors rounded). Shared: the first
        step as :meth:`step` runs it on the 16-bit rows (``x``: their exact float32 copy):
        P_i and Q_i rounded to ``dtype``, P̂ Q_iᵀ in float32 (the caller rounds it once)."""
        if not self.shared:
            return super()._apply_half(x, keys, dtype)
        _require_finite(x, self.name)
        if x.numel() == 0:
            return x.clone()
        a, b = self._finite_factors(x.to(dtype), keys, torch.float32)
        return self._vectors(self._product(a, b), x.shape)

    def _encode_fields(self, w: BitWriter, x: torch.Tensor, keys: Keys | None) -> None:
        """Per-client: the factors P̂ and Qᵀ (or the values of C(x)). Shared: what a client of
        the collective sends, P (m × r; one vector: its own P_1 = M Q0) then Q_1ᵀ (r × n),
        r(m + n) values; the receiver forms P̂ = orthonormalize(P) itself."""
        if not self.shared:
            super()._encode_fields(w, x, keys)
            return
        _require_finite(x, self.name)
        vd = w.value_dtype
        p_sum, _, q = self._shared_first(x if vd is None else x.to(vd))
        w.add_values(p_sum.reshape(-1))
        w.add_values(q.transpose(-1, -2).reshape(-1))

    def _decode_fields(
        self,
        r: BitReader,
        d: int,
        dtype: torch.dtype,
        keys: Keys | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """Per-client: :meth:`LowRank._decode_fields`. Shared: P̂ = orthonormalize(P) of the
        received P, then P̂ Qᵀ, the same stages as the sender's C(x) (bit for bit)."""
        if not self.shared:
            return super()._decode_fields(r, d, dtype, keys, out)
        m, n = self.matrix_shape(d)
        p_sum = r.read_values(m * self.r, dtype).reshape(m, self.r)
        b = r.read_values(self.r * n, dtype).reshape(1, self.r, n)
        p_hat = self.orthonormal_basis(p_sum).to(dtype)
        return self._vectors(self._product(p_hat[None], b), torch.Size([d]))
