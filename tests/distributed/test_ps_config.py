"""Parameter-server configuration, step-size plan, wire format and client data (no processes)."""

from __future__ import annotations

import math

import pytest
import torch

from shrinkgrad.distributed.ps import (
    ClientOracle,
    PSConfig,
    client_problem,
    load_ps_config,
    plan_run,
)
from shrinkgrad.distributed.ps.wire import (
    HEADER_BYTES,
    MODEL,
    STOP,
    grad_header,
    model_message,
    pack_model,
    read_header,
    unpack_model,
)
from shrinkgrad.methods.delayed import delayed_theory
from shrinkgrad.methods.gd import dcgd_theory
from shrinkgrad.problems import make_problem
from shrinkgrad.theory import stepsize_delayed

A1A = "logistic_regression[dataset=a1a]"


@pytest.fixture(scope="module")
def a1a3() -> object:
    return make_problem("logistic_regression[dataset=a1a,n_clients=3]")


# -- validation -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"workers": 0}, "workers"),
        ({"tau_max": 1, "workers": 3}, r"tau_max must be an integer >= 2"),
        ({"stepsize": "theory", "workers": 3}, "needs a delay bound"),
        ({"mode": "sync", "method": "iag"}, "method='dcgd'"),
        ({"mode": "sync", "method": "dcgd", "tau_max": 3}, "sync runs have none"),
        ({"speeds": (1.0, 2.0), "workers": 3, "tau_max": 2}, "one entry per worker"),
        ({"speeds": (1.0, -1.0), "workers": 2, "tau_max": 1}, "speeds"),
        ({"problem": "logistic_regression[dataset=a1a,n_clients=5]", "tau_max": 3}, "n_clients=5"),
        ({"tau_max": 3, "assume_tau": 3}, "not both"),
        ({"kill_workers": {7: 3}, "tau_max": 3}, "workers are 0..3"),
        ({"divergence_factor": 0.5, "tau_max": 3}, "divergence_factor"),
        ({"stepsize": "theory*x", "tau_max": 3}, "step size"),
    ],
)
def test_config_mistakes_are_named(changes: dict[str, object], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        PSConfig(**changes)  # type: ignore[arg-type]


def test_problem_spec_gets_one_client_per_worker() -> None:
    cfg = PSConfig(problem=A1A, workers=3, tau_max=2)
    assert cfg.problem_spec() == "logistic_regression[dataset=a1a,n_clients=3]"
    assert cfg.first_counter == 0  # iag's initial table message is round 0
    assert cfg.replace(init="zero").first_counter == 1
    assert cfg.replace(method="dcgd").first_counter == 1
    assert cfg.replace(speeds=(1, 1, 5), delay=0.01).worker_delay(2) == pytest.approx(0.05)


def test_toml_shares_the_experiment_format_and_names_unknown_keys() -> None:
    text = """
        problem = "logistic_regression[dataset=a1a]"
        [run]
        rounds = 250
        log_every = 5
        seed = 7
        [ps]
        workers = 4
        method = "dcgd"
        compressor = "qsgd[s=4]"
        tau_max = 6
        speeds = [1, 1, 1, 5]
        delay = 0.01
        kill_workers = {"2" = 10}
    """
    cfg = load_ps_config(text=text)
    assert (cfg.updates, cfg.log_every, cfg.seed, cfg.workers) == (250, 5, 7, 4)
    assert cfg.speeds == (1.0, 1.0, 1.0, 5.0) and cfg.kill_workers == {2: 10}
    assert load_ps_config(text=text, overrides={"tau_max": 9}).tau_max == 9
    with pytest.raises(ValueError, match="did you mean 'tau_max'"):
        load_ps_config(text=text.replace("tau_max", "tau_mx"))
    with pytest.raises(ValueError, match="rounds = server updates"):
        load_ps_config(text=text.replace("rounds = 250", "rounds = 250\nseeds = 3"))
    with pytest.raises(ValueError, match="takes one problem"):
        load_ps_config(text='[problem]\nname = "logistic_regression"\n[problem.sweep]\nx = [1]\n')
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_ps_config("/nonexistent/ps.toml")


# -- step sizes ----------------------------------------------------------------------------------
def test_theory_step_uses_the_delay_bound_of_each_method(a1a3: object) -> None:
    iag = plan_run(PSConfig(problem=A1A, workers=3, tau_max=4, compressor="qsgd[s=4]"), a1a3)
    dcgd = plan_run(PSConfig(problem=A1A, workers=3, tau_max=4, method="dcgd"), a1a3)
    sync = plan_run(PSConfig(problem=A1A, workers=3, mode="sync", method="dcgd"), a1a3)
    assumed = plan_run(PSConfig(problem=A1A, workers=3, assume_tau=11, stepsize="theory*2"), a1a3)
    const = plan_run(PSConfig(problem=A1A, workers=3, stepsize=0.3), a1a3)
    # IAG's table entries are up to 2·tau_max old: the rule is evaluated at τ = 8
    assert iag.tau_bound == 8 and dcgd.tau_bound == 4 and assumed.tau_bound == 11
    assert iag.stepsize == delayed_theory(iag.cfg, 8)[0]
    assert dcgd.stepsize == pytest.approx(0.99 * stepsize_delayed(a1a3.L, 4))  # type: ignore[attr-defined]
    assert sync.stepsize == dcgd_theory(sync.cfg)[0] and sync.cfg.stepsize_rule == "stepsize_dcgd"
    assert assumed.stepsize == pytest.approx(2 * delayed_theory(assumed.cfg, 11)[0])
    assert assumed.cfg.stepsize_rule.endswith("*2")
    assert (const.stepsize, const.cfg.stepsize_rule, const.tau_bound) == (0.3, "constant", None)
    # the theory step of the delay rule shrinks like 1/τ
    assert iag.stepsize < dcgd.stepsize < sync.stepsize


def test_biased_compressors_are_refused_before_anything_starts(a1a3: object) -> None:
    with pytest.raises(ValueError, match="unbiased"):
        plan_run(PSConfig(problem=A1A, workers=3, tau_max=2, compressor="top_k[k=2]"), a1a3)


# -- wire format ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_model_message_round_trip(dtype: torch.dtype) -> None:
    x = torch.linspace(-3, 3, 17, dtype=dtype)
    buf = model_message(17, dtype)
    assert buf.numel() == HEADER_BYTES + 17 * x.element_size()
    kind, version, y = unpack_model(pack_model(buf, MODEL, 12345678901, x), dtype)
    assert (kind, version) == (MODEL, 12345678901) and torch.equal(y, x)
    assert unpack_model(pack_model(buf, STOP, 3, None), dtype)[:2] == (STOP, 3)
    with pytest.raises(ValueError, match="does not fit"):
        pack_model(buf, MODEL, 0, torch.zeros(5, dtype=dtype))
    assert read_header(grad_header(1, 7, 5, 99)) == (1, 7, 5, 99)


# -- a worker's own data -------------------------------------------------------------------------
@pytest.mark.parametrize("split", ["contiguous", "shuffled[seed=3]"])
def test_client_problem_is_the_clients_share_bit_for_bit(split: str) -> None:
    spec = f"logistic_regression[dataset=a1a,split={split}]"
    full = make_problem(f"logistic_regression[dataset=a1a,n_clients=3,split={split}]")
    cfg = PSConfig(problem=spec, workers=3, tau_max=2)
    x = torch.linspace(-0.2, 0.3, full.d, dtype=torch.float64)
    for i in range(3):
        own = client_problem(cfg, i)
        assert own is not None and own.n == 1
        assert int(own.client_sizes[0]) == int(full.client_sizes[i])  # type: ignore[index]
        oracle = ClientOracle(own, i)
        assert torch.equal(oracle.grads(x, torch.tensor([i]))[0], full.client_grads(x)[i])
        with pytest.raises(ValueError, match="only holds its own data"):
            oracle.grads(x, torch.tensor([(i + 1) % 3]))


def test_non_dataset_problems_fall_back_to_the_full_problem() -> None:
    cfg = PSConfig(problem="synthetic_least_squares[d=5]", workers=2, tau_max=1)
    assert client_problem(cfg, 0) is None


def test_nonfinite_model_is_a_divergence_not_a_crash() -> None:
    own = client_problem(PSConfig(problem=A1A, workers=2, tau_max=1), 0)
    assert own is not None
    x = torch.full((own.d,), math.nan, dtype=torch.float64)
    with pytest.raises(ValueError, match="non-finite"):
        ClientOracle(own, 0).grads(x, torch.tensor([0]))


def test_cli_set_reads_dotted_keys_and_toml_values() -> None:
    from shrinkgrad.cli.ps import _set_value, _speeds

    assert _set_value("ps.tau_max=6") == ("tau_max", 6)
    assert _set_value("run.rounds = 50") == ("updates", 50)
    assert _set_value("compressor=qsgd[s=4]") == ("compressor", "qsgd[s=4]")
    assert _set_value("speeds=[1, 2]") == ("speeds", [1, 2])
    assert _speeds("1, 1,5") == (1.0, 1.0, 5.0)
    with pytest.raises(ValueError, match="KEY=VALUE"):
        _set_value("tau_max")
    with pytest.raises(ValueError, match="one per worker"):
        _speeds("1,fast")


def test_config_is_a_hashable_value() -> None:
    a = PSConfig(tau_max=3, kill_workers={1: 3})
    b = PSConfig(tau_max=3, kill_workers={"1": 3})  # TOML keys are strings
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.replace(tau_max=4) != a
