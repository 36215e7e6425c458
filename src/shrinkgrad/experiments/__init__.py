"""Experiments: TOML configs, grids of simulations run in parallel, and paper reproductions."""
