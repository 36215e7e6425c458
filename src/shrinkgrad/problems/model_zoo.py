"""Registered neural-network problems: ``mlp[...]`` and ``cnn[...]``, with keyed initialisation.

* ``mlp[dataset=a9a, hidden=64, depth=1, n_clients=20, ...]``: a fully connected network
  (``depth`` hidden layers of width ``hidden``, ReLU or tanh) on the flattened features of any
  bundled dataset (the LIBSVM files, ``digits``);
* ``cnn[dataset=digits, channels=8, n_clients=20, ...]``: a small convolutional network on image
  data, conv 3×3 (``channels``) → ReLU → max-pool 2 → conv 3×3 (2·``channels``) → ReLU →
  max-pool 2 → linear to the classes (1,898 parameters at channels = 8 on 8×8 digits: 80 + 1,168
  in the convolutions, 650 in the linear layer).

Both are :func:`~shrinkgrad.problems.model_problem` problems (cross-entropy by default; the
other parameters are passed through). Their weights are drawn with shrinkgrad's keyed randomness
(never torch's global generator): every ``Linear``/``Conv2d`` weight and bias is uniform on
[−1/√fan_in, 1/√fan_in] (the distribution of torch's default initialisation), parameter k of the
model drawn from ``Keys.derive(seed, client=k, stream="model_init")``, and stored in float32
(:data:`INIT_DTYPE`: the modules are built in it, whatever torch's default dtype) before the
problem casts it to its ``dtype``. So a spec names one network: the same ``seed`` gives the same
x⁰ in every process, including one that called ``torch.set_default_dtype`` (stop 35's audit).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch

from ..rng import Keys
from .base import PROBLEMS
from .datasets import load
from .model import ModelProblem, model_problem
from .splits import Split

__all__ = ["INIT_DTYPE", "SmallCNN", "cnn", "keyed_init_", "mlp", "mlp_module"]

Activation = Literal["relu", "tanh"]
LossName = Literal["cross_entropy", "logistic", "mse"]
_ACTIVATIONS: dict[str, type[torch.nn.Module]] = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh}

#: the dtype the registered networks are built and initialised in (their keyed float64 draws
#: are rounded to it): explicit, so x⁰ does not depend on ``torch.get_default_dtype()``;
#: float32, torch's usual default, so x⁰ is the one the networks have always had
INIT_DTYPE = torch.float32


def keyed_init_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Draw every Linear/Conv weight and bias uniformly on ±1/√fan_in with keyed randomness."""
    index = {id(p): k for k, p in enumerate(module.parameters())}
    with torch.no_grad():
        for layer in module.modules():
            if not isinstance(layer, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d)):
                continue
            bound = 1.0 / math.sqrt(layer.weight[0].numel())
            for p in (layer.weight, layer.bias):
                if p is None:
                    continue
                keys = Keys.derive(seed, client=index[id(p)], stream="model_init")
                u = keys.uniform(p.numel()).reshape(p.shape)
                p.copy_((2.0 * u - 1.0) * bound)
    return module


def _outputs(loss: str, n_classes: int) -> int:
    return n_classes if loss == "cross_entropy" else 1


def mlp_module(
    d_in: int,
    d_out: int,
    hidden: int = 64,
    depth: int = 1,
    activation: Activation = "relu",
    dtype: torch.dtype = INIT_DTYPE,
) -> torch.nn.Sequential:
    """Linear(d_in, hidden) → act → (depth − 1) × [Linear(hidden, hidden) → act] → Linear(·, out).

    ``d_out`` outputs; ``act`` is ReLU or tanh; parameters in ``dtype`` (:data:`INIT_DTYPE`,
    not torch's default dtype).
    """
    for what, v in (("hidden", hidden), ("depth", depth)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{what} must be a positive integer, got {v!r}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(_ACTIVATIONS)}, got {activation!r}")
    layers: list[torch.nn.Module] = []
    width = d_in
    for _ in range(depth):
        layers += [torch.nn.Linear(width, hidden, dtype=dtype), _ACTIVATIONS[activation]()]
        width = hidden
    layers.append(torch.nn.Linear(width, d_out, dtype=dtype))
    return torch.nn.Sequential(*layers)


class SmallCNN(torch.nn.Module):
    """conv3×3(c) → ReLU → maxpool 2 → conv3×3(2c) → ReLU → maxpool 2 → flatten → linear.

    Parameters in ``dtype`` (:data:`INIT_DTYPE`, not torch's default dtype).
    """

    def __init__(
        self,
        image_shape: Sequence[int],
        n_outputs: int,
        channels: int = 8,
        dtype: torch.dtype = INIT_DTYPE,
    ) -> None:
        super().__init__()
        if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
            raise ValueError(f"channels must be a positive integer, got {channels!r}")
        c_in, h, w = (int(s) for s in image_shape)
        if h < 4 or w < 4:
            raise ValueError(f"the images must be at least 4×4 for two 2×2 poolings, got {h}×{w}")
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(c_in, channels, 3, padding=1, dtype=dtype),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(channels, 2 * channels, 3, padding=1, dtype=dtype),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
        )
        self.head = torch.nn.Linear(2 * channels * (h // 4) * (w // 4), n_outputs, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.features(x))
        return out


@PROBLEMS.register("mlp")
def mlp(
    dataset: str = "a9a",
    n_clients: int | None = None,
    split: str | Split | Sequence[Any] = "contiguous",
    hidden: int = 64,
    depth: int = 1,
    activation: Activation = "relu",
    loss: LossName = "cross_entropy",
    test: float = 0.2,
    seed: int = 0,
    dtype: str | torch.dtype = "float64",
    device: str | torch.device | None = "cpu",
    batch_size: int | None = None,
) -> ModelProblem:
    """A fully connected network (depth layers of hidden units, ReLU/tanh) on a dataset's features.

    Cross-entropy over the classes by default (a LIBSVM file: 2 outputs), or the logistic loss /
    mse with one output; ``test``: the held-out fraction; ``seed``: the keyed initialisation and
    the held-out rows.
    """
    ds = load(dataset)
    net = mlp_module(ds.n_features, _outputs(loss, ds.n_classes), hidden, depth, activation)
    p = model_problem(
        keyed_init_(net, seed),
        ds,
        n_clients=n_clients,
        split=split,
        loss=loss,
        batch_size=batch_size,
        seed=seed,
        test=test,
        dtype=dtype,
        device=device,
        name="mlp",
    )
    return p


@PROBLEMS.register("cnn")
def cnn(
    dataset: str = "digits",
    n_clients: int | None = None,
    split: str | Split | Sequence[Any] = "contiguous",
    channels: int = 8,
    test: float = 0.2,
    seed: int = 0,
    dtype: str | torch.dtype = "float64",
    device: str | torch.device | None = "cpu",
    batch_size: int | None = None,
) -> ModelProblem:
    """A small CNN (:class:`SmallCNN`) with cross-entropy on an image dataset (``digits``)."""
    ds = load(dataset)
    if ds.image_shape is None:
        raise ValueError(
            f"cnn needs image data; dataset {ds.name!r} has no image shape (image datasets: "
            "digits); use mlp[dataset=...] for feature vectors"
        )
    net = SmallCNN(ds.image_shape, ds.n_classes, channels)
    return model_problem(
        keyed_init_(net, seed),
        ds,
        n_clients=n_clients,
        split=split,
        loss="cross_entropy",
        batch_size=batch_size,
        seed=seed,
        test=test,
        dtype=dtype,
        device=device,
        input_shape=ds.image_shape,
        name="cnn",
    )
