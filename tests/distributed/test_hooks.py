"""The DDP communication hooks on real gloo process groups (forked ranks on 127.0.0.1)."""

from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_helpers import ClientLoss, Job, expected_bytes, run
from torch.nn.parallel import DistributedDataParallel as DDP

from shrinkgrad.distributed import CompressionState, WorkerError, compression_hook, spawn
from shrinkgrad.methods.base import methods_for
from shrinkgrad.problems import load, logistic_regression, resolve_split
from shrinkgrad.sim import simulate

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(90)]


def _same_on_all_ranks(results: list[dict[str, Any]]) -> None:
    steps = len(results[0]["params"])
    for t in range(steps):
        for r in results[1:]:
            assert torch.equal(r["params"][t], results[0]["params"][t]), f"ranks differ at step {t}"


# --------------------------------------------------------------------------------------------
# exact reductions
# --------------------------------------------------------------------------------------------
def test_identity_hook_equals_no_hook_exactly() -> None:
    plain = spawn(run, 2, (Job(steps=4),))
    hooked = spawn(run, 2, (Job(compressor="identity", min_numel=0, steps=4),))
    for t in range(4):
        # same division, same all-reduce of the same buffer: bit-identical, every step
        assert torch.equal(hooked[0]["params"][t], plain[0]["params"][t])
    assert hooked[0]["bytes_sent"] == 4 * sum(p.numel() for p in plain[0]["params"][:1]) * 4


def test_identity_with_ef21_equals_no_hook_to_round_off() -> None:
    job = Job(steps=4, dtype=torch.float64)
    plain = spawn(run, 2, (job,))
    hooked = spawn(run, 2, (dataclasses.replace(job, compressor="identity", method="ef21"),))
    for t in range(4):  # g + (x − g) = x up to round-off
        torch.testing.assert_close(
            hooked[1]["params"][t], plain[1]["params"][t], rtol=0, atol=1e-13
        )


def test_client_momentum_with_identity_is_heavy_ball_sgd() -> None:
    job = Job(steps=5, dtype=torch.float64)
    plain = spawn(run, 2, (job,))  # SGD(lr, momentum=0.5), DDP's all-reduce
    hooked = spawn(
        run, 2, (dataclasses.replace(job, compressor="identity", client_momentum=True),)
    )  # v_i ← 0.5 v_i + 0.5 x_i on the ranks, SGD(lr / 0.5) without momentum
    for t in range(5):
        torch.testing.assert_close(
            hooked[0]["params"][t], plain[0]["params"][t], rtol=0, atol=1e-13
        )


# --------------------------------------------------------------------------------------------
# every compressor family and error feedback: identical parameters on every rank, every step
# --------------------------------------------------------------------------------------------
CONFIGS = [
    Job(compressor="top_k", ratio=0.1, method="ef21"),
    Job(compressor="top_k", ratio=0.05, method="ef"),
    Job(compressor="top_k", ratio=0.1, method="ef21_w", weights=[1.0, 2.0, 5.0]),
    Job(compressor="rand_k[shared_seed=true]", ratio=0.1),  # values only, all-reduce
    Job(compressor="strat_k[shared_seed=true]", ratio=0.1),  # the same, one index per block
    Job(compressor="strat_k", ratio=0.1, method="diana"),  # block offsets on the wire
    # ratio= sets the k inside scaled(): the contractive strat_k, still on the values path
    Job(compressor="scaled(strat_k[shared_seed=true])", ratio=0.1, method="ef21"),
    Job(compressor="rand_k_scaled[shared_seed=true]", ratio=0.2, method="ef21"),
    # the same operator through the wrapper: still a shared-seed sparsifier (values path)
    Job(compressor="scaled(rand_k[k=4,shared_seed=true])", method="ef21", min_numel=16),
    Job(compressor="qsgd[s=4]"),  # random, per-rank keys
    Job(compressor="bernoulli[p=0.2]"),  # variable-size messages: sizes exchanged, padding
    Job(compressor="scaled(natural)", method="ef21"),
    Job(compressor="top_k", ratio=0.1, method="ef21", client_momentum=True),
]


@pytest.mark.parametrize("job", CONFIGS, ids=lambda j: f"{j.compressor}-{j.method}")
def test_every_rank_holds_identical_parameters_after_every_step(job: Job) -> None:
    results = spawn(run, 3, (job,))
    _same_on_all_ranks(results)
    first, last = results[0]["params"][0], results[0]["params"][-1]
    assert bool(torch.isfinite(last).all())
    assert not torch.equal(first, last)  # it trained


# --------------------------------------------------------------------------------------------
# bytes at the collective = the bits formulas
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "job",
    [
        Job(compressor="top_k", ratio=0.1, method="ef21", record_bytes=True),
        Job(compressor="rand_k[shared_seed=true]", ratio=0.1, record_bytes=True),
        Job(compressor="strat_k[shared_seed=true]", ratio=0.1, record_bytes=True),
        Job(compressor="strat_k", ratio=0.1, record_bytes=True),
        Job(
            compressor="scaled(strat_k[shared_seed=true])",
            ratio=0.1,
            method="ef21",
            record_bytes=True,
        ),
        # the k scaled values only, all-reduced: scaled() keeps the shared seed
        Job(
            compressor="scaled(rand_k[k=4,shared_seed=true])",
            method="ef21",
            min_numel=16,
            record_bytes=True,
        ),
        Job(compressor="qsgd[s=4]", record_bytes=True, min_numel=100),
        Job(compressor="identity", record_bytes=True),
    ],
    ids=lambda j: j.compressor,
)
def test_bytes_sent_per_step_equal_the_bits_formula(job: Job) -> None:
    results = spawn(run, 2, (job,))
    dense = sum(p.numel() for p in results[0]["params"][:1]) * 4
    want = expected_bytes(job, 2)
    for r in results:
        # step 0 is the dense warm-up; then exactly Σ ⌈bits(d)/8⌉ (+ raw small tensors)
        assert r["sent"] == [dense] + [want] * (job.steps - 1)
        assert r["state_bytes"] == r["sent"]
        assert r["bytes_sent"] == sum(r["sent"])
    if job.compressor == "top_k":
        assert want < dense / 4


# --------------------------------------------------------------------------------------------
# one implementation, two runtimes: the EF21 hook = the simulator's EF21
# --------------------------------------------------------------------------------------------
def _ef21_on_ranks(
    rank: int, world: int, mode: str, spec: str, gamma: float, steps: int, weights: list[float]
) -> list[torch.Tensor]:
    data = load("a1a")
    parts, _ = resolve_split("contiguous", data, world)
    A = torch.from_numpy(data.X[parts[rank]].toarray())
    y = torch.from_numpy(data.y[parts[rank]])
    model = DDP(ClientLoss(A.shape[1], 0.1))
    state = CompressionState(
        spec,
        method=mode,
        weights=weights if mode == "ef21_w" else None,
        min_numel=0,
        warmup_steps=0 if mode == "ef" else 1,  # EF21's warm-up is its init="full"; EF has none
    )
    model.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(model.parameters(), lr=gamma)
    xs = []
    for _ in range(steps):
        opt.zero_grad()
        model(A, y).backward()
        opt.step()
        xs.append(model.module.x.detach().clone())
    return xs


@pytest.mark.parametrize("mode", ["ef21", "ef21_w", "ef"])
def test_ef21_hook_follows_the_simulators_trajectory(mode: str) -> None:
    world, steps, spec = 4, 25, "top_k[k=5]"
    problem = logistic_regression("a1a", n_clients=world, split="contiguous", lam=0.1)
    gamma = 0.5 / problem.L
    xs_sim: list[torch.Tensor] = []

    def record(r: int, state: Any) -> None:
        xs_sim.append(state.x.clone())

    simulate(problem, mode, spec, stepsize=gamma, rounds=steps, callback=record)
    # [S14]'s EF keeps e = γ e' of the hook's learning-rate-free memory e' (top_k is homogeneous)
    weights = problem.L_i.tolist()
    xs = spawn(_ef21_on_ranks, world, (mode, spec, gamma, steps, weights))
    assert len(xs_sim) == steps
    for t in range(steps):
        assert torch.equal(xs[0][t], xs[3][t])
        torch.testing.assert_close(xs[0][t], xs_sim[t], rtol=0, atol=1e-10)
    assert float((xs_sim[-1] - xs_sim[0]).norm()) > 1e-3  # the trajectory moves


# --------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "job",
    [
        Job(compressor="top_k", ratio=0.1, method="ef21", steps=6),
        Job(compressor="rand_k_scaled", ratio=0.2, method="ef", steps=6, seed=3),
        Job(compressor="qsgd[s=2]", steps=6, client_momentum=True),
        # PowerSGD's shared Q is part of the method's state and continues with it
        Job(compressor="power_sgd[rank=2,shared=true]", method="ef21", steps=6),
        # every bucket one unit: the entries are joined into the restarted job's initial
        # layout, then split and joined again at DDP's rebuild (tests/.../test_hooks_bucket.py)
        Job(
            compressor="top_k",
            ratio=0.1,
            method="ef21",
            steps=6,
            bucket_cap_mb=0.02,
            granularity="bucket",
        ),
        # ... and where DDP's rebuilt layout (two buckets, the parameters in backward order)
        # is not its initial one (one bucket of all parameters in model order), which a
        # restarted job's first iteration has: that iteration still compresses the units the
        # checkpoint saved, not the bucket DDP hands it (tensors permuted, two units in one)
        Job(
            compressor="top_k",
            ratio=0.1,
            method="ef",
            steps=6,
            bucket_cap_mb=0.004,
            granularity="bucket",
        ),
        Job(
            compressor="rand_k[shared_seed=true]",
            ratio=0.1,
            steps=6,
            dtype=torch.bfloat16,
            bucket_cap_mb=0.002,
            granularity="bucket",
        ),
        # the contractive strat_k (ratio= inside scaled()) under EF21 in bf16: its values
        # all-gathered and summed in float32 (summation="auto"), per bucket, restarted
        Job(
            compressor="scaled(strat_k[shared_seed=true])",
            ratio=0.1,
            method="ef21",
            steps=6,
            dtype=torch.bfloat16,
            bucket_cap_mb=0.002,
            granularity="bucket",
        ),
    ],
    ids=lambda j: f"{j.compressor}-{j.method}-{j.granularity}-{j.bucket_cap_mb}-{j.dtype}",
)
def test_restart_from_a_checkpoint_continues_the_same_trajectory(job: Job, tmp_path: Path) -> None:
    straight = spawn(run, 2, (job,))
    prefix = str(tmp_path / "ckpt")
    first = spawn(run, 2, (dataclasses.replace(job, steps=3, save=prefix),))
    # fresh processes: new DDP (initial bucket layout again), state restored from the files
    second = spawn(run, 2, (dataclasses.replace(job, start=3, steps=3, load=prefix),))
    for r in range(2):
        got = first[r]["params"] + second[r]["params"]
        for t in range(6):
            assert torch.equal(got[t], straight[r]["params"][t]), f"rank {r}, step {t}"
        assert second[r]["bytes_sent"] == straight[r]["bytes_sent"]


def test_a_restart_with_a_larger_bucket_cap_continues_the_saved_units_until_ddp_rebuilds(
    tmp_path: Path,
) -> None:
    """``granularity="bucket"``, saved with two bucket units (``bucket_cap_mb=0.004``) and
    restored at DDP's default 25 MB: the restarted job's first step (DDP's initial layout)
    compresses the two saved units, as the uninterrupted job does; from DDP's rebuild on, its
    one bucket of all parameters is compressed as DDP groups it — no staged copy, and the next
    checkpoint records that one unit."""
    job = Job(compressor="top_k", ratio=0.1, method="ef", steps=4, bucket_cap_mb=0.004)
    job = dataclasses.replace(job, granularity="bucket")
    straight = spawn(run, 2, (job,))
    prefix = str(tmp_path / "ckpt")
    first = spawn(run, 2, (dataclasses.replace(job, steps=3, save=prefix),))
    assert first[0]["layout"] == [[5, 4, 3, 2], [1, 0]]  # backward order, two buckets
    rest = dataclasses.replace(job, start=3, steps=3, load=prefix, bucket_cap_mb=25.0)
    second = spawn(run, 2, (rest,))
    for r in range(2):
        assert torch.equal(second[r]["params"][0], straight[r]["params"][3])
        assert second[r]["layout"] == [[5, 4, 3, 2, 1, 0]] and not second[r]["staged"]


def _check_mismatched_checkpoint(rank: int, world: int, path: str) -> str:
    state = CompressionState("top_k", ratio=0.1, method="ef21")
    other = CompressionState("top_k", ratio=0.2, method="ef21")
    try:
        other.load_state_dict(state.state_dict())
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_checkpoint_of_another_configuration_is_refused() -> None:
    (msg,) = spawn(_check_mismatched_checkpoint, 1, ("",))
    assert msg == (
        "the checkpoint was saved with another hook configuration (ratio: saved 0.1, now 0.2)"
    )


# --------------------------------------------------------------------------------------------
# failures
# --------------------------------------------------------------------------------------------
def test_a_rank_dying_during_training_stops_the_others_with_a_clear_error() -> None:
    job = Job(compressor="top_k", ratio=0.1, method="ef21", steps=6, die_at=3)
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        spawn(run, 3, (job,), pg_timeout=20.0)
    assert time.monotonic() - t0 < 15.0  # the survivors notice the closed connection at once
    by_rank = {f.rank: f for f in info.value.failures}
    assert by_rank[1].message == "exited with code 7 without a result"
    for r in (0, 2):
        assert "a peer process died or stopped responding" in by_rank[r].message


def _user_errors(rank: int, world: int) -> list[str]:
    out = []
    attempts: list[dict[str, Any]] = [
        {"compressor": "top_k", "method": "ef21_w"},
        {"compressor": "top_k", "method": "ef21", "weights": [1.0]},
        {"compressor": "qsgd[s=4]", "ratio": 0.1},
        {"compressor": "top_k", "ratio": 1.5},
        {"compressor": "top_k", "error_feedback": "ef22"},
        {"compressor": "nope"},
        {"compressor": "top_k", "method": "ef21", "error_feedback": "ef21"},
        {"compressor": "top_k", "method": "ef21_sgdm", "momentum": 0.5},
        {"compressor": "top_k", "method": "ef21_sgd[b=4]"},
        {"compressor": "top_k", "method": "iag"},
        # a method and a compressor that cannot run together: refused by the method's own
        # check (Method.bind) when the state is built, also where no tensor of the model would
        # reach min_numel (the tensors' own check would then never run)
        {"compressor": "rand_k", "ratio": 0.1, "method": "ef21"},
        {"compressor": "top_k", "ratio": 0.1, "method": "dcgd"},
        {"compressor": "top_k", "ratio": 0.1, "method": "gd"},
        {"compressor": "rand_k", "ratio": 0.1, "method": "ef21", "min_numel": 10**9},
        {"compressor": "top_k[k=5]", "ratio": 0.05},  # which k? (it used to drop k=5)
        {"compressor": "rand_k[shared_seed=true]", "ratio": 0.1, "method": "ef"},
        {"compressor": "strat_k[shared_seed=true]", "ratio": 0.1, "method": "ef21"},
        {"compressor": "scaled(strat_k[k=3])", "ratio": 0.1},  # which k?
    ]
    for kw in attempts:
        try:
            CompressionState(**kw)
            out.append("no error")
        except (ValueError, TypeError) as e:
            out.append(str(e))
    dist.barrier()
    return out


def test_user_mistakes_are_clear_errors() -> None:
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        CompressionState("top_k", ratio=0.01)
    (msgs,) = spawn(_user_errors, 1)
    hook_methods = ", ".join(methods_for("hook"))
    first = [m.split(";")[0] for m in msgs]
    assert first == [
        "method 'ef21_w' needs weights: one positive number per rank, e.g. the ranks' "
        "smoothness constants L_i ([EFR] Alg. 2: w_i = L_i / Σ_j L_j)",
        "weights are the ranks' weights of a weighted method (method='ef21_w')",
        "ratio=0.1 needs a compressor with a k parameter (top_k, rand_k, rand_k_scaled, "
        "strat_k, or scaled() of one), got 'qsgd[s=4]'",
        "ratio must be a number in (0, 1] (e.g. 0.01 for 1%), got 1.5",
        "error_feedback must be one of none, ef, ef21, ef21_w, got 'ef22'",
        first[5],
        "give method= or the deprecated error_feedback=, not both (got method='ef21', "
        "error_feedback='ef21')",
        "momentum=0.5 and method 'ef21_sgdm' both put a momentum on the clients",
        first[8],
        "iag has no per-tensor rule for a DDP communication hook",
        "ef21 needs a contractive compressor (E‖C(x) − x‖² ≤ (1 − α)‖x‖², [EF21] Def. 1)",
        "dcgd needs an unbiased compressor (E[Q(x)] = x, [K18] Def. 1)",
        first[12],
        "ef21 needs a contractive compressor (E‖C(x) − x‖² ≤ (1 − α)‖x‖², [EF21] Def. 1)",
        "'top_k[k=5]' fixes k=5 and ratio=0.05 sets k per tensor (k = ⌈ratio·d⌉): give one of "
        "them (drop ratio=, or k from the name)",
        "ef needs a contractive compressor (E‖C(x) − x‖² ≤ (1 − α)‖x‖², [EF21] Def. 1)",
        "ef21 needs a contractive compressor (E‖C(x) − x‖² ≤ (1 − α)‖x‖², [EF21] Def. 1)",
        "'scaled(strat_k[k=3])' fixes k=3 and ratio=0.1 sets k per tensor (k = ⌈ratio·d⌉): "
        "give one of them (drop ratio=, or k from the name)",
    ]
    # with ratio=, the advice names the contractive form that takes it and keeps the shared
    # seed: rand_k_scaled for rand_k, scaled() of the compressor otherwise
    assert msgs[15].endswith(
        "(with ratio=: CompressionState('rand_k_scaled[shared_seed=true]', ratio=0.1))"
    )
    assert msgs[16].endswith(
        "(with ratio=: CompressionState('scaled(strat_k[shared_seed=true])', ratio=0.1))"
    )
    assert first[12].startswith("gd sends uncompressed gradients and takes no compressor")
    assert first[5].startswith("unknown compressor 'nope'")
    assert first[8].startswith("ef21_sgd[b=4] samples minibatches through the problem's oracle")
    # a method that cannot run in a hook names those that can
    for m in (msgs[8], msgs[9]):
        assert m.endswith(f"the methods that run there: {hook_methods}")
    assert "Use scaled(rand_k[k=" in msgs[10]  # and the method's check says what to use


def _compressed_or_warned(rank: int, world: int) -> list[list[str]]:
    """The hook's warnings over two steps of a small model (every tensor below min_numel),
    and of the same model with min_numel=0."""
    out = []
    for min_numel in (1024, 0):
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(20, 50), torch.nn.Linear(50, 1)))
        state = CompressionState("top_k", ratio=0.1, method="ef21", min_numel=min_numel)
        model.register_comm_hook(state, compression_hook)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):
                model(torch.ones(2, 20)).sum().backward()
        out.append([str(w.message) for w in seen if issubclass(w.category, UserWarning)])
    dist.barrier()
    return out


def test_a_model_with_nothing_to_compress_is_warned_about_once() -> None:
    """The README's two lines on a model whose tensors all have fewer than min_numel entries
    compress nothing: the hook says so (once, at the end of the first iteration), and names
    the option; a model with a compressed tensor gets no such warning."""
    (small, compressed), _ = spawn(_compressed_or_warned, 2)
    assert small == [
        "CompressionState: no tensor of this model has min_numel=1024 entries or more, so "
        "nothing is compressed (every gradient is sent dense by ef21); lower min_numel to "
        "compress smaller tensors"
    ]
    assert compressed == []


def _aliases(rank: int, world: int) -> list[str]:
    with pytest.warns(DeprecationWarning, match=r"use method='ef21'") as record:
        state = CompressionState("top_k", ratio=0.1, error_feedback="ef21")
    assert len(record) == 1
    names = [state.method.name]
    for ef, warmup, momentum in [
        ("none", 1, 0.0),
        ("ef", 1, 0.0),
        ("ef21", 0, 0.0),
        ("ef21_w", 1, 0.0),
        ("ef21", 1, 0.5),
        ("none", 1, 0.5),
    ]:
        with pytest.warns(DeprecationWarning):
            state = CompressionState(
                "top_k",
                ratio=0.1,
                error_feedback=ef,  # type: ignore[arg-type]
                warmup_steps=warmup,
                momentum=momentum,
                weights=[1.0] if ef == "ef21_w" else None,
            )
        names.append(state.method.name)
    return names


def test_the_deprecated_error_feedback_names_map_to_methods() -> None:
    (names,) = spawn(_aliases, 1)
    assert names == [
        "ef21",
        "dcgd[biased=true]",
        "ef",
        "ef21[init=zero]",  # warmup_steps=0: EF21's memory started at zero
        "ef21_w",
        "ef21_sgdm[beta=0.5]",
        "dcgd[biased=true]+momentum[beta=0.5]",
    ]


@pytest.mark.parametrize(
    ("alias", "method"),
    [
        (Job(compressor="top_k", ratio=0.1, error_feedback="ef21"), "ef21"),
        (Job(compressor="qsgd[s=4]", error_feedback="none"), None),
        (Job(compressor="top_k", ratio=0.1, error_feedback="ef21", client_momentum=True), None),
    ],
    ids=["ef21", "none", "ef21-momentum"],
)
def test_an_alias_trains_exactly_like_its_method(alias: Job, method: str | None) -> None:
    """error_feedback= is only a name: the same parameters, bit for bit, as method=. With
    momentum, method='ef21_sgdm[beta=0.5]' (and no momentum=) is the same again."""
    if alias.client_momentum:
        job = dataclasses.replace(
            alias, error_feedback=None, method="ef21_sgdm[beta=0.5]", client_momentum=False
        )
        a = spawn(run, 2, (alias,))
        b = spawn(run, 2, (dataclasses.replace(job, momentum_free=True),))
    else:
        a = spawn(run, 2, (alias,))
        b = spawn(run, 2, (dataclasses.replace(alias, error_feedback=None, method=method),))
    for r in range(2):
        for t in range(alias.steps):
            assert torch.equal(a[r]["params"][t], b[r]["params"][t])
        assert a[r]["bytes_sent"] == b[r]["bytes_sent"]


def _old_checkpoint(rank: int, world: int) -> str:
    state = CompressionState("top_k", ratio=0.1, method="ef21")
    old = dict(state.state_dict(), format="shrinkgrad.distributed.CompressionState/1")
    try:
        state.load_state_dict(old)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_checkpoint_of_the_old_format_is_refused_with_what_to_do() -> None:
    (msg,) = spawn(_old_checkpoint, 1)
    assert "format 'shrinkgrad.distributed.CompressionState/1'" in msg
    assert "start the hook state afresh" in msg


def test_chain_starts_the_second_collective_from_the_first_without_blocking() -> None:
    """collectives.chain: the path of a compressor with two rounds of communication (low-rank
    factors) starts the second from the first one's callback and never waits there."""
    from shrinkgrad.distributed.hooks.collectives import chain

    first: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    second: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    started = []

    def then(f: torch.futures.Future[list[torch.Tensor]]) -> torch.futures.Future[torch.Tensor]:
        started.append(f.value()[0])
        return second

    out = chain(first, then)
    assert not out.done() and not started
    first.set_result([torch.ones(2)])
    assert len(started) == 1 and not out.done()  # the second collective is in flight
    second.set_result(torch.full((2,), 3.0))
    assert out.done() and torch.equal(out.value(), torch.full((2,), 3.0))
    failing: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    broken = chain(failing, then)
    failing.set_exception(RuntimeError("peer died"))
    with pytest.raises(RuntimeError, match="peer died"):
        broken.wait()
