"""Example configurations of the registered methods, for the method contract suite.

Every registered method is covered automatically by its default configuration (the name alone,
e.g. ``"ef21"``). Add a method here when

* it cannot be built from its name alone (a required parameter): then it MUST appear, or
  ``test_every_method_has_a_configuration`` fails naming it; or
* a variant behaves differently enough to deserve its own run through the contract (an
  initialisation, participation, minibatches, a delay model, ...).

Each entry is a list of method specs; the contract suite picks the compressor from the method's
``requires`` (unbiased: rand-k; contractive: scaled rand-k, a random draw per client and round;
none: the identity).
"""

from __future__ import annotations

EXAMPLES: dict[str, list[str]] = {
    "delayed_dcgd": [
        "delayed_dcgd[tau=0]",
        "delayed_dcgd[tau=2,model=fixed]",
        "delayed_dcgd[tau=2,model=random]",
        "delayed_dcgd[tau=3,model=cyclic]",
    ],
    "diana": ["diana[init=full]", "diana[alpha=0.1]"],
    "ef21": ["ef21[init=compressed]", "ef21[init=zero]"],
    "ef21_plus": ["ef21_plus[init=compressed]", "ef21_plus[init=zero]"],
    "ef21_pp": ["ef21_pp[p=0.5]", "ef21_pp[p=1.0]"],
    "ef21_sgd": ["ef21_sgd[b=2]"],
    "ef21_w": ["ef21_w[init=compressed]"],
    "ef21_w_pp": ["ef21_w_pp[p=0.6]", "ef21_w_pp[p=1.0]"],
    "ef21_w_sgd": ["ef21_w_sgd[b=2]"],
    "iag": ["iag[order=random]", "iag[init=full]"],
}
