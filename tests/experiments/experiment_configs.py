"""Small experiment configs shared by the experiment tests (a module of its own: ``conftest``
is not importable by name when several test directories have one)."""

#: a valid config: 2 problems (a sweep) × 3 arms (a grid of 2 + a pair) × 2 seeds = 12 runs
SMALL = """
name = "small"
description = "two datasets, EF21 vs EF21-W and DCGD"

[problem]
name = "logistic_regression"
n_clients = 4
lam = 0.1

[problem.sweep]
dataset = ["a1a", "australian_scale"]

[run]
rounds = 12
log_every = 4
seeds = 2

[grid]
methods = ["ef21", "ef21_w"]
compressors = ["top_k[k=2]"]

[[pairs]]
method = "dcgd"
compressor = "rand_k[k=3]"
stepsize = "1/L"

[profiles.tiny]
run.rounds = 6
"""
