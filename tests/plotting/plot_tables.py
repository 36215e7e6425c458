"""Results tables made up by hand for the plotting tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd


def make_table(
    curves: list[tuple[str, str]],
    *,
    problems: tuple[str, ...] = ("dataset=a",),
    seeds: int = 3,
    rounds: int = 8,
    value: Callable[[str, str, int, int, str], float] | None = None,
    status: Callable[[str, str, int, str], str] | None = None,
    extra: Callable[[str, str, int, int, str], dict[str, Any]] | None = None,
) -> pd.DataFrame:
    """One row per problem × (method, compressor) × seed × round; ``value(method, compressor,
    seed, round, problem)`` gives ‖∇f‖² (default (1 + 0.1 seed)·0.5^r)."""
    rows = []
    for p in problems:
        for method, comp in curves:
            for seed in range(seeds):
                st = status(method, comp, seed, p) if status else "completed"
                for r in range(rounds):
                    g = value(method, comp, seed, r, p) if value else (1 + 0.1 * seed) * 0.5**r
                    row = {
                        "round": r,
                        "grad_norm_sq": g,
                        "loss": 0.3 + 0.3 * 0.7**r,
                        "bits_up": 100.0 * r,
                        "bits_up_paper": 32.0 * r,
                        "bits_down": 320.0 * r,
                        "time_s": 0.01 * r,
                        "method": method,
                        "compressor": comp,
                        "stepsize": 0.1,
                        "stepsize_rule": "stepsize_ef21",
                        "stepsize_spec": "theory",
                        "seed_index": seed,
                        "run_id": f"{p}-{method}-{comp}-{seed}",
                        "problem_label": p,
                        "n_clients": 10,
                        "d": 5,
                        "L_var": 0.5,
                        "L_AM": 2.0,
                        "L_QM": 2.5,
                        "status": st,
                    }
                    if extra:
                        row.update(extra(method, comp, seed, r, p))
                    rows.append(row)
    return pd.DataFrame(rows)
