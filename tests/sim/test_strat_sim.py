"""strat_k in the simulator: DCGD against an independent loop over the compressor (with and
without a shared seed), EF21 with scaled(strat_k[k=d]) = the identity, the theory step sizes
with the shared draw's n = 1, the honest bit counts and determinism for a seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from methods_fixtures import LeastSquares

from shrinkgrad.compressors import make_compressor
from shrinkgrad.methods.base import KeyStream
from shrinkgrad.sim import simulate


@pytest.mark.parametrize("spec", ["strat_k[k=3]", "strat_k[k=3,shared_seed=true]"])
def test_dcgd_follows_an_independent_loop(lsq: LeastSquares, spec: str) -> None:
    """x ← x − γ (1/n) Σ_i C(∇f_i(x)) with the simulator's compressor keys (round t + 1, one
    stream for every client when the seed is shared), and bits_up = rounds · bits(d)."""
    gamma, rounds, seed = 0.5 / lsq.L, 6, 11
    res = simulate(lsq, "dcgd", spec, stepsize=gamma, rounds=rounds, seed=seed)
    C = make_compressor(spec)
    shared = "shared_seed=true" in spec
    ids = np.zeros(lsq.n, dtype=np.int64) if shared else np.arange(lsq.n)
    ks = KeyStream(seed, ids, stream="compressor/shared" if shared else "compressor")
    x = torch.zeros(lsq.d, dtype=lsq.dtype)
    for t in range(rounds):
        G = lsq.client_grads(x)
        M = C(G, ks.at(t + 1))
        idx = C.sparse(G, ks.at(t + 1))[0]
        # one draw for every client with a shared seed: the same coordinates in every row
        assert bool((idx == idx[:1]).all()) == shared
        x = x - gamma * M.mean(0)
    torch.testing.assert_close(torch.as_tensor(res.x), x, rtol=0, atol=1e-12)
    assert not torch.equal(x, torch.zeros_like(x))
    assert float(res.table["bits_up"].iloc[-1]) == rounds * C.bits(lsq.d)
    assert C.bits(lsq.d) == 3 * (32 + (0 if shared else 2))  # blocks 2, 3, 3: 2-bit offsets
    assert float(res.table["bits_up_paper"].iloc[-1]) == rounds * 3 * 32


def test_theory_steps_take_one_draw_with_a_shared_seed(lsq: LeastSquares) -> None:
    """DCGD's 1/(L + 2ωL_max/n) with ω = ⌈d/k⌉ − 1 = 2, n → 1 with a shared seed."""
    L_max = float(lsq.L_i.max())
    for spec, n in [("strat_k[k=3]", lsq.n), ("strat_k[k=3,shared_seed=true]", 1)]:
        res = simulate(lsq, "dcgd", spec, stepsize="theory", rounds=1, seed=0)
        assert res.stepsize == pytest.approx(1 / (lsq.L + 2 * 2 * L_max / n), rel=1e-12)


@pytest.mark.parametrize("method", ["ef21", "ef"])
@pytest.mark.parametrize("shared", [False, True])
def test_scaled_strat_k_with_one_entry_a_block_is_the_identity(
    lsq: LeastSquares, method: str, shared: bool
) -> None:
    spec = f"scaled(strat_k[k={lsq.d}{',shared_seed=true' if shared else ''}])"
    a = simulate(lsq, method, spec, stepsize=0.3 / lsq.L, rounds=8, seed=2)
    b = simulate(lsq, method, "identity", stepsize=0.3 / lsq.L, rounds=8, seed=2)
    assert torch.equal(torch.as_tensor(a.x), torch.as_tensor(b.x))
    cols = ["round", "grad_norm_sq", "loss"]
    assert a.table[cols].equals(b.table[cols])


def test_ef21_with_scaled_strat_k_is_deterministic_for_a_seed(lsq: LeastSquares) -> None:
    spec = "scaled(strat_k[k=3])"
    runs = [simulate(lsq, "ef21", spec, stepsize="theory", rounds=10, seed=s) for s in (5, 5, 6)]
    cols = [c for c in runs[0].table.columns if c != "time_s"]
    assert runs[0].table[cols].equals(runs[1].table[cols])
    assert not runs[0].table[cols].equals(runs[2].table[cols])
    # the initialisation sends the d gradient values, then one strat_k message per round
    bits = float(runs[0].table["bits_up"].iloc[-1])
    assert bits == 32 * lsq.d + 10 * make_compressor(spec).bits(lsq.d)
