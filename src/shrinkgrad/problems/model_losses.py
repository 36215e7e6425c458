"""The per-sample losses of model problems: cross-entropy, logistic and squared error.

A model problem (:mod:`shrinkgrad.problems.model`) has f_i(x) = (1/m_i) Σ_{j ∈ client i}
ℓ(h(x; a_j), y_j) with h the network's output. Each loss here says how to compute ℓ row-wise on a
(client's) batch of outputs, what counts as a correct prediction (for the held-out accuracy), and
which labels it accepts (converting a dataset's labels to its targets):

========================  ===========================================  ============================
``loss``                  ℓ(h; y)                                       targets, output
========================  ===========================================  ============================
``"cross_entropy"``       −h_y + log Σ_c exp h_c                        class index y ∈ {0 … C−1};
                                                                        C outputs per sample
``"logistic"``            log(1 + exp(−y h))                            y ∈ {±1}; one output
``"mse"``                 ‖h − y‖² (no ½, as the linear least squares)  real y (or a vector); as
                                                                        many outputs
========================  ===========================================  ============================

A binary LIBSVM dataset's labels ±1 become the classes 0 (−1) and 1 (+1) for cross-entropy; the
multi-class ``digits`` labels are class indices and work with cross-entropy only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["LOSSES", "ModelLoss", "make_loss"]


@dataclasses.dataclass(frozen=True)
class ModelLoss:
    """One per-sample loss (see the module docstring).

    ``per_sample(out, y)`` maps a batch of outputs (m, …) and targets (m, …) to the (m,) losses;
    ``correct(out, y)`` to (m,) booleans, or is None when accuracy is meaningless (regression);
    ``targets(y, n_classes, dtype, where)`` converts labels (``n_classes`` is the dataset's class
    count, or None for user data) or raises a ValueError saying what is wrong;
    ``check_output(out_shape, y_shape)`` returns why an output shape does not fit, or None;
    ``output_grad(out, y)`` is ∂ℓ/∂h row-wise, the (m, C) derivative with respect to a 2-D
    output (the start of the hand-written backward pass of
    :mod:`~shrinkgrad.problems.model_sequential`; None: models use the generic ``vmap`` path).
    """

    name: str
    formula: str
    per_sample: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    correct: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    targets: Callable[[np.ndarray, int | None, torch.dtype, str], torch.Tensor]
    check_output: Callable[[tuple[int, ...], tuple[int, ...]], str | None]
    output_grad: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    @property
    def held_out_columns(self) -> tuple[str, ...]:
        """The held-out metrics of a problem with this loss."""
        return ("test_loss", "test_accuracy") if self.correct is not None else ("test_loss",)


# -- cross-entropy ------------------------------------------------------------------------------
def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def _ce_grad(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """∂ℓ/∂h = softmax(h) − e_y."""
    g = torch.softmax(out, dim=-1)
    g.scatter_add_(-1, y[:, None], torch.full_like(g[:, :1], -1.0))
    return g


def _ce_correct(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return out.argmax(dim=-1) == y


def _ce_targets(
    y: np.ndarray, n_classes: int | None, dtype: torch.dtype, where: str
) -> torch.Tensor:
    if y.ndim != 1:
        raise ValueError(
            f"{where}: cross_entropy needs one class index per sample, got y of shape {y.shape}"
        )
    if n_classes == 2:  # a binary dataset: −1 → class 0, +1 → class 1
        return torch.from_numpy((y > 0).astype(np.int64))
    if not np.all(np.isfinite(y)) or not np.all(y == np.round(y)) or (y.size and y.min() < 0):
        raise ValueError(
            f"{where}: cross_entropy needs integer class indices 0 … C−1 as labels (got values "
            f"such as {_examples(y)}); use loss='mse' for real-valued targets"
        )
    return torch.from_numpy(y.astype(np.int64))


def _ce_output(out: tuple[int, ...], y: tuple[int, ...]) -> str | None:
    if len(out) != 2:
        return f"cross_entropy needs an output of shape (batch, classes), got {out}"
    return None


# -- logistic -----------------------------------------------------------------------------------
def _margin(out: torch.Tensor) -> torch.Tensor:
    return out.reshape(out.shape[0])


def _logistic(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """log(1 + e^{−y h}) = logaddexp(0, −y h), exact for every margin (no overflow: logaddexp is
    max(a, b) + log1p(e^{−|a−b|})). Not ``F.softplus``, which returns its input beyond the
    threshold 20 (off by up to e^{−20} ≈ 2·10⁻⁹, with derivative exactly 1 instead of σ(−y h):
    stop 35's audit). Autograd's derivative is 1/(1 + e^{y h}) = σ(−y h), the formula of
    :func:`_logistic_grad`, so both evaluation paths compute the same function."""
    z = -y * _margin(out)
    return torch.logaddexp(torch.zeros_like(z), z)


def _logistic_grad(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """∂ℓ/∂h = −y σ(−y h)."""
    return (-y * torch.sigmoid(-y * _margin(out))).reshape(out.shape)


def _logistic_correct(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (_margin(out) > 0) == (y > 0)


def _pm1_targets(
    y: np.ndarray, n_classes: int | None, dtype: torch.dtype, where: str
) -> torch.Tensor:
    if n_classes is not None and n_classes != 2:
        raise ValueError(
            f"{where}: the logistic loss needs two classes (±1); this dataset has {n_classes}: use "
            "loss='cross_entropy'"
        )
    if y.ndim != 1 or not np.all(np.isin(y, (-1.0, 1.0))):
        raise ValueError(
            f"{where}: the logistic loss needs labels −1 or +1 (got values such as "
            f"{_examples(y)}); map 0/1 labels with y = 2y − 1, or use loss='cross_entropy'"
        )
    return torch.from_numpy(np.array(y, dtype=np.float64)).to(dtype)


def _logistic_output(out: tuple[int, ...], y: tuple[int, ...]) -> str | None:
    if not (len(out) == 1 or (len(out) == 2 and out[1] == 1)):
        return (
            f"the logistic loss needs one output per sample, shape (batch,) or (batch, 1), got "
            f"{out}"
        )
    return None


# -- squared error ------------------------------------------------------------------------------
def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    r = out.reshape(y.shape) - y
    return (r * r).reshape(r.shape[0], -1).sum(dim=1)


def _mse_grad(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """∂ℓ/∂h = 2 (h − y)."""
    return (2.0 * (out.reshape(y.shape) - y)).reshape(out.shape)


def _real_targets(
    y: np.ndarray, n_classes: int | None, dtype: torch.dtype, where: str
) -> torch.Tensor:
    if n_classes is not None and n_classes != 2:
        raise ValueError(
            f"{where}: mse on class indices of a {n_classes}-class dataset is not a meaningful "
            "regression; use loss='cross_entropy' or pass (X, y) with real-valued targets"
        )
    if not np.all(np.isfinite(y)):
        raise ValueError(f"{where}: the targets must be finite (found NaN or inf)")
    return torch.from_numpy(np.array(y, dtype=np.float64)).to(dtype)


def _mse_output(out: tuple[int, ...], y: tuple[int, ...]) -> str | None:
    if int(np.prod(out)) != int(np.prod(y)) or out[0] != y[0]:
        return f"mse needs one output per target: targets of shape {y}, output of shape {out}"
    return None


def _examples(y: np.ndarray) -> str:
    vals = np.unique(y.reshape(-1))[:4]
    return ", ".join(f"{v:g}" for v in vals) + (", …" if np.unique(y).size > 4 else "")


#: the losses of model problems, by name
LOSSES: dict[str, ModelLoss] = {
    "cross_entropy": ModelLoss(
        "cross_entropy",
        "−h_y + log Σ_c exp h_c",
        _ce,
        _ce_correct,
        _ce_targets,
        _ce_output,
        _ce_grad,
    ),
    "logistic": ModelLoss(
        "logistic",
        "log(1 + exp(−y h))",
        _logistic,
        _logistic_correct,
        _pm1_targets,
        _logistic_output,
        _logistic_grad,
    ),
    "mse": ModelLoss("mse", "‖h − y‖²", _mse, None, _real_targets, _mse_output, _mse_grad),
}


def make_loss(name: str | ModelLoss) -> ModelLoss:
    """The loss called ``name`` (one of :data:`LOSSES`), or a ValueError listing them."""
    if isinstance(name, ModelLoss):
        return name
    try:
        return LOSSES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"loss must be one of {', '.join(repr(k) for k in LOSSES)}, got {name!r}"
        ) from None
