"""The axes a figure can have: names, the results column behind each, labels and scales.

Light on purpose (no pandas or matplotlib): the command line reads its ``--x``/``--y`` choices
from here. The labels say exactly what each column counts:

* ``bits`` (``bits_up``): the honest uplink count per client — every bit of the encoded
  message as the wire format sends it (values, indices, norms, scales, size headers);
* ``bits_paper`` (``bits_up_paper``): the count the papers' plots use, per client — 32 bits
  for every float a message carries (a sparsifier's values, a quantizer's norm or scale), each
  quantized coordinate at its level width plus its sign bit, indices free
  (``Compressor.paper_bits``; QSGD with s = 4 is 32 + 4d, Top-k is 32k);
* ``bits_down`` (``bits_down``): the honest downlink count per client;
* ``time_model`` (``time_model_s``): the modelled wall-clock time on a network
  (:mod:`shrinkgrad.network`), when the run was given one.
"""

from __future__ import annotations

import dataclasses

__all__ = ["AXES", "X_AXES", "Y_AXES", "Axis", "axis_of"]


@dataclasses.dataclass(frozen=True)
class Axis:
    """An axis: the results ``column``, its ``label``, and whether y is drawn on a log scale."""

    column: str
    label: str
    log: bool = False


#: --x names → axes
_X = {
    "bits": Axis("bits_up", "uplink bits per client (honest: values + indices + norms/scales)"),
    "bits_paper": Axis(
        "bits_up_paper",
        "#bits / n (papers' count: 32 per float sent,\nquantized levels at their width, "
        "indices free)",
    ),
    "bits_down": Axis("bits_down", "downlink bits per client (honest)"),
    "rounds": Axis("round", "rounds"),
    "time": Axis("time_s", "time (s, excluding metric evaluation)"),
    "time_model": Axis("time_model_s", "modelled wall-clock time on the network (s)"),
}
#: --y names → axes
_Y = {
    "grad_norm_sq": Axis("grad_norm_sq", "‖∇f(xᵗ)‖²", log=True),
    "loss": Axis("loss", "f(xᵗ)", log=True),
    "test_loss": Axis("test_loss", "held-out loss", log=True),
    "test_accuracy": Axis("test_accuracy", "held-out accuracy"),
}

#: --x names and the results column each one plots
X_AXES: dict[str, str] = {k: a.column for k, a in _X.items()}
#: --y names and the results column each one plots
Y_AXES: dict[str, str] = {k: a.column for k, a in _Y.items()}
#: every axis by its results column
AXES: dict[str, Axis] = {a.column: a for a in (*_X.values(), *_Y.values())}


def axis_of(column: str) -> Axis:
    """The axis of a results column (a plain one, log y for positive metrics, for others)."""
    return AXES.get(column, Axis(column, column))
