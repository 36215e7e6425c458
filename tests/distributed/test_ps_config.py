"""Parameter-server configuration, step-size plan, wire format and client data (no processes)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from shrinkgrad.distributed.ps import (
    PSConfig,
    client_oracle,
    load_ps_config,
    plan_run,
    prepare,
    run_ps,
)
from shrinkgrad.distributed.ps.wire import (
    COMPRESSED,
    HEADER_BYTES,
    MODEL,
    RESUME,
    STOP,
    model_message,
    pack_model,
    read_reply,
    reply_header,
    unpack_model,
)
from shrinkgrad.methods.delayed import delayed_theory
from shrinkgrad.methods.gd import NOT_CONVEX, dcgd_theory
from shrinkgrad.problems import Problem, make_problem
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
        ({"mode": "sync", "method": "iag"}, "incremental"),
        ({"mode": "sync", "method": "dcgd", "tau_max": 3}, "sync runs have none"),
        ({"mode": "sync", "method": "dcgd", "assume_tau": 3}, "sync runs have no delay"),
        ({"timeout": 0.001, "tau_max": 3}, r"timeout must be at least 1 second .*got 0.001"),
        ({"method": "ef12"}, "did you mean 'ef21'"),
        ({"method": "foo"}, r"unknown method 'foo'.*run on a parameter server: dcgd, ef21, "),
        ({"method": "delayed_dcgd[tau=2]"}, r"staleness is real.*run on a parameter server: dcgd"),
        ({"method": "ef21_pp[p=0.5]"}, "every arrival takes part"),
        ({"method": "iag[order=sideways]"}, "'order' must be one of"),
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


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        # the first real problem is reported, not the step size's missing delay bound
        ({"speeds": (1.0, 2.0)}, "one entry per worker"),
        ({"updates": -5}, "updates"),
        ({"compressor": "top_k[k=2]"}, "unbiased"),
        ({"compressor": "qsgd[s=4]", "method": "ef21"}, "contractive"),
        ({}, "needs a delay bound"),
        ({"method": "ef21", "compressor": "top_k[k=2]"}, "no theory step size with stale"),
    ],
)
def test_the_first_real_problem_is_reported(
    changes: dict[str, object], match: str, a1a3: object
) -> None:
    cfg = {"problem": A1A, "workers": 3, "stepsize": "theory", **changes}
    with pytest.raises((ValueError, TypeError), match=match):
        plan_run(PSConfig(**cfg), a1a3)  # type: ignore[arg-type]


def test_problem_spec_gets_one_client_per_worker() -> None:
    cfg = PSConfig(problem=A1A, workers=3, tau_max=2)
    assert cfg.problem_spec() == "logistic_regression[dataset=a1a,n_clients=3]"
    assert cfg.replace(speeds=(1, 1, 5), delay=0.01).worker_delay(2) == pytest.approx(0.05)
    sync = cfg.replace(method="dcgd", mode="sync", tau_max=None)
    assert cfg.run_method == "async_iag" and sync.run_method == "sync_dcgd"
    assert cfg.replace(method="iag[init=zero]").run_method == "async_iag[init=zero]"


def test_the_default_compressor_compresses_and_fits_the_method() -> None:
    cfg = PSConfig(workers=2, tau_max=1)
    assert cfg.compressor is None and cfg.compressor_spec == "qsgd[s=8]"
    assert cfg.replace(method="ef21").compressor_spec == "scaled(qsgd[s=8])"
    assert cfg.replace(compressor="rand_k[k=3]").compressor_spec == "rand_k[k=3]"
    with pytest.raises(ValueError, match=r"iag\[init=zero\]"):
        PSConfig.from_dict({"init": "zero"})


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
    assert sync.stepsize == dcgd_theory(sync.cfg)[0]
    assert sync.cfg.stepsize_rule == "stepsize_dcgd" + NOT_CONVEX  # a1a's reg is nonconvex
    assert assumed.stepsize == pytest.approx(2 * delayed_theory(assumed.cfg, 11)[0])
    assert assumed.cfg.stepsize_rule.endswith("*2")
    assert (const.stepsize, const.cfg.stepsize_rule, const.tau_bound) == (0.3, "constant", None)
    # the theory step of the delay rule shrinks like 1/τ
    assert iag.stepsize < dcgd.stepsize < sync.stepsize


def test_biased_compressors_are_refused_before_anything_starts(a1a3: object) -> None:
    with pytest.raises(ValueError, match="unbiased"):
        plan_run(PSConfig(problem=A1A, workers=3, tau_max=2, compressor="top_k[k=2]"), a1a3)


def test_a_minibatch_larger_than_a_workers_data_is_refused_before_anything_starts(
    a1a3: object, tmp_path: Path
) -> None:
    """Every worker would fail at its first gradient; the launcher says so first, naming the
    client and the largest batch that fits, and no process starts (nothing is written)."""
    sizes = a1a3.client_sizes  # type: ignore[attr-defined]
    smallest = int(sizes.min())
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=rf"batch_size.*b = {smallest + 1} .*use b <= {smallest}"):
        run_ps(
            PSConfig(problem=A1A, workers=3, stepsize=0.1, batch_size=smallest + 1),
            problem=a1a3,
            out=out,
        )  # type: ignore[arg-type]
    assert not out.exists()
    prepare(PSConfig(problem=A1A, workers=3, stepsize=0.1, batch_size=smallest), a1a3)  # type: ignore[arg-type]


def test_one_worker_with_tau_max_0_admits_its_own_theory_step() -> None:
    """``--workers 1 --tau-max 0``: the theory step is the DCGD rule (no staleness) and the
    check at the measured delay 0 is that rule's (non-strict), not the delay rule's γ < 1/L."""
    one = make_problem("logistic_regression[dataset=a1a,n_clients=1]")
    for method in ("iag", "dcgd"):
        plan = plan_run(PSConfig(problem=A1A, workers=1, tau_max=0, method=method), one)
        # a1a's default regularizer is nonconvex: the rule says it is used outside its theorem
        assert plan.tau_bound == 0 and plan.cfg.stepsize_rule == "stepsize_dcgd" + NOT_CONVEX
        bound, holds = plan.inner.async_admissible(plan.cfg, plan.stepsize, 0)
        assert holds and bound == plan.stepsize
        assert not plan.inner.async_admissible(plan.cfg, plan.stepsize * 1.01, 0)[1]
    # with staleness the [K18] rule is strict: its own bound is not admitted
    plan = plan_run(PSConfig(problem=A1A, workers=1, tau_max=0, stepsize=1.0), one)
    bound, _ = plan.inner.async_admissible(plan.cfg, 1.0, 3)
    assert bound == pytest.approx(stepsize_delayed(one.L, 3))
    assert plan.inner.async_admissible(plan.cfg, bound, 3) == (bound, False)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"method": "ef21_sgd[b=4]", "batch_size": 8, "stepsize": 0.1}, "draws its own minibatch"),
        ({"method": "ef21", "mode": "sync", "batch_size": 8}, r"step assumes exact gradients"),
        ({"method": "dcgd", "compressor": "rand_k[k=3]", "batch_size": 8}, "assumes exact"),
        (
            {"method": "ef21", "compressor": "power_sgd[rank=1,shared=true]", "stepsize": 0.1},
            r"shared basis is one collective",
        ),
    ],
)
def test_what_a_parameter_server_cannot_run_as_the_simulator_does_is_refused(
    options: dict[str, object], match: str
) -> None:
    """Three configurations that used to run as another algorithm than the simulator's, or
    with a theory step of the wrong rule (stop 34's runtime audit), are one-line errors."""
    a1a2 = make_problem("logistic_regression[dataset=a1a,n_clients=2]")
    options = {"compressor": "top_k[k=3]", **options}
    if options.get("mode") != "sync":
        options["tau_max"] = 2
    with pytest.raises(ValueError, match=match):
        plan_run(PSConfig(problem=A1A, workers=2, **options), a1a2)  # type: ignore[arg-type]
    # the same without the offending part runs
    fine = {k: v for k, v in options.items() if k != "batch_size"}
    if "shared" in str(fine["compressor"]):
        fine["compressor"] = "power_sgd[rank=1]"
    plan_run(PSConfig(problem=A1A, workers=2, **fine), a1a2)  # type: ignore[arg-type]


# -- wire format ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_model_message_round_trip(dtype: torch.dtype) -> None:
    x = torch.linspace(-3, 3, 17, dtype=dtype)
    buf = model_message(17, dtype)
    assert buf.numel() == HEADER_BYTES + 17 * x.element_size()
    kind, version, counter, nbytes, y = unpack_model(pack_model(buf, MODEL, 12345678901, x), dtype)
    assert (kind, version, counter, nbytes) == (MODEL, 12345678901, 0, 0) and torch.equal(y, x)
    assert unpack_model(pack_model(buf, STOP, 3, None), dtype)[:2] == (STOP, 3)
    resume = unpack_model(pack_model(buf, RESUME, 40, x, counter=17, nbytes=256), dtype)
    assert resume[:4] == (RESUME, 40, 17, 256)
    with pytest.raises(ValueError, match="does not fit"):
        pack_model(buf, MODEL, 0, torch.zeros(5, dtype=dtype))
    traffic = (1234.0, 0.1 + 0.2, 2.0**60)  # floats travel bit for bit
    *ints, got = read_reply(reply_header(1, 7, 5, 99, COMPRESSED, 6, traffic))
    assert ints == [1, 7, 5, 99, COMPRESSED, 6]
    assert tuple(float(t[0]) for t in got) == traffic


@pytest.mark.parametrize("comp", ["rand_k[k=12,shared_seed=true]", "rand_k[k=12]", "qsgd[s=4]"])
def test_the_server_decodes_the_vector_each_client_computed(comp: str) -> None:
    """The payload's keys are the method's own (Config.keys): a shared-seed rand_k message
    (its k values, no indices) decodes to the client's vector, whose coordinates every client
    shares. Before stop 34 the wire re-derived per-client keys, and decoded another vector."""
    from shrinkgrad.distributed.ps.wire import decode_payload, encode_payload
    from shrinkgrad.methods import ProblemOracle, make_method
    from shrinkgrad.methods.asynchronous import client_init, client_update

    prob = make_problem("logistic_regression[dataset=a1a,n_clients=2]")
    method = make_method("ef21[init=zero]")
    cfg = method.bind(prob, f"scaled({comp})", 0.5, 3, wire_dtype=torch.float64).cfg
    supports = []
    for client in (0, 1):
        ids = torch.tensor([client])
        clients, _ = client_init(method, cfg, prob.x0(), ProblemOracle(prob), ids)
        _, sent = client_update(method, cfg, prob.x0(), clients, ProblemOracle(prob), 1)
        kind, payload = encode_payload(sent, cfg, client)
        got = decode_payload(
            kind, payload, cfg, client, sent.round, cfg.d, cfg.wire_dtype, cfg.dtype
        )
        assert got is not None and torch.equal(got, sent.vector)
        supports.append(sent.vector[0].nonzero().flatten().tolist())
    if "shared_seed" in comp:
        assert supports[0] == supports[1]  # one draw for both clients


# -- a worker's own data -------------------------------------------------------------------------
@pytest.mark.parametrize("split", ["contiguous", "shuffled[seed=3]"])
def test_a_worker_holds_its_clients_data_bit_for_bit(split: str) -> None:
    full = make_problem(f"logistic_regression[dataset=a1a,n_clients=3,split={split}]")
    x = torch.linspace(-0.2, 0.3, full.d, dtype=torch.float64)
    for i in range(3):
        oracle = client_oracle(full, i)
        assert oracle.local is not None and oracle.local.n == 1  # Problem.restrict
        assert torch.equal(oracle.grads(x, torch.tensor([i]))[0], full.client_grads(x)[i])
        with pytest.raises(ValueError, match="not held by this rank"):
            oracle.grads(x, torch.tensor([(i + 1) % 3]))


class _Whole(Problem):
    """A problem that cannot be cut to one client (``restrict`` returns None)."""

    def __init__(self, inner: Problem) -> None:
        self.inner = inner
        self.n, self.d, self.L, self.L_i = inner.n, inner.d, inner.L, inner.L_i
        self.name, self.dataset = inner.name, inner.dataset

    def loss(self, x: torch.Tensor) -> float:
        return self.inner.loss(x)

    def client_grads(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.client_grads(x)

    def client_grads_at(self, X: torch.Tensor) -> torch.Tensor:
        return self.inner.client_grads_at(X)


def test_a_problem_that_cannot_be_cut_is_said_and_still_exact(a1a3: object) -> None:
    whole = _Whole(a1a3)  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="cannot be cut to one client"):
        prepare(PSConfig(problem=A1A, workers=3, tau_max=2), whole)
    x = torch.linspace(-0.2, 0.3, whole.d, dtype=torch.float64)
    oracle = client_oracle(whole, 1)
    assert oracle.local is None
    assert torch.equal(oracle.grads(x, torch.tensor([1]))[0], a1a3.client_grads(x)[1])  # type: ignore[attr-defined]


def test_nonfinite_model_is_a_divergence_not_a_crash(a1a3: object) -> None:
    x = torch.full((a1a3.d,), math.nan, dtype=torch.float64)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="NaN or inf"):
        client_oracle(a1a3, 0).grads(x, torch.tensor([0]))  # type: ignore[arg-type]


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


def _readme_ps_commands() -> list[list[str]]:
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    found = re.findall(r"shrinkgrad ps (--[^`#\n]*)", text)
    return [shlex.split(cmd) for cmd in found]


def test_the_readme_parameter_server_examples_show_a_slow_worker_and_compress() -> None:
    """Issue 12 item 3: the README's example used to do nothing (no delay, no compression)."""
    from shrinkgrad.cli.ps import build_config, ps_cmd
    from shrinkgrad.compressors import make_compressor

    commands = _readme_ps_commands()
    assert len(commands) >= 2
    for argv in commands:
        params = ps_cmd.make_context("ps", argv).params
        flags = {
            k: v
            for k, v in params.items()
            if k not in ("config", "sets", "out", "no_plot", "no_progress", "as_json", "speeds")
            and k != "resume"
        }
        cfg = build_config(params["config"], params["sets"], params["speeds"], flags)
        assert cfg.speeds is not None and len(set(cfg.speeds)) > 1, argv
        assert cfg.delay > 0, argv  # the speeds make one worker slower
        C = make_compressor(cfg.compressor_spec)
        assert C.kind == "unbiased" and C.omega(100) > 0, argv  # it compresses


def test_the_staleness_figure_marks_tau_max_and_the_delay_bound_each_on_its_axis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The left panel is staleness (bounded by tau_max), the right one the [K18] delay, which
    for the IAG is bounded by 2·tau_max: each dashed line sits on its own panel."""
    import matplotlib.figure
    import pandas as pd

    from shrinkgrad.distributed.ps import plot_staleness

    seen: list[object] = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: seen.append(fig))
    st = pd.DataFrame({"worker": [0, 1, 0, 1], "staleness": [0, 2, 1, 3], "delay": [0, 4, 2, 6]})
    plot_staleness(st, tmp_path / "s.png", tau_max=3, delay_bound=6)
    (fig,) = seen
    left, right = fig.axes  # type: ignore[attr-defined]
    assert [ln.get_xdata()[0] for ln in left.get_lines()] == [3]
    assert [ln.get_xdata()[0] for ln in right.get_lines()] == [6]
    assert right.get_legend().get_texts()[0].get_text() == "delay bound = 6"
