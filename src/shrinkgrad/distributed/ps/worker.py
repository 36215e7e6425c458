"""The worker side of the parameter server: its client's data, gradient, compression and loop.

Worker i (rank i + 1) holds client i's data only (:func:`client_oracle`). Its loop ([K18], the
asynchronous parameter server):

1. receive x^t and its version t from the server (or STOP);
2. compute g = ∇f_i(x^t) (or a minibatch estimate, sampled with the key (seed, "minibatch", i, k));
3. compress and encode it: payload = C.encode(g, key (seed, "compressor", i, k)), which decodes to
   exactly C(g, key), the vector the methods' client step ``cfg.compress`` sends in round k;
4. wait until ``delay × speeds[i]`` seconds have passed since step 2 began (artificial speed);
5. send (k, t, payload); k ← k + 1.

The same two pieces as :class:`~shrinkgrad.methods.DCGD`'s client step (a
:class:`~shrinkgrad.methods.GradientOracle` and the keyed compressor; keys from
:class:`~shrinkgrad.rng.KeyStream`, as ``Config.keys``), so a one-worker run reproduces the
simulator's iterates (tests/distributed/test_ps_run.py). A worker whose server disappears (the
connection closes, or it is silent for ``2·timeout`` seconds) prints one line and exits with
:data:`EXIT_SERVER_LOST`.
"""

from __future__ import annotations

import datetime
import inspect
import os
import signal
import sys
import time

import torch

from ...compressors import make_compressor
from ...methods.base import GradientOracle, NonFiniteError
from ...methods.oracle import ProblemOracle
from ...problems import Problem
from ...registry import Spec, parse_spec
from ...rng import Keys, KeyStream
from .config import PSConfig
from .wire import FAIL, GRAD, MODEL, STOP, grad_header, model_message, recv, send, unpack_model

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_SERVER_LOST",
    "ClientOracle",
    "client_oracle",
    "client_problem",
    "run_worker",
]

#: a worker's exit status: stopped by the server / lost its server / failed computing
EXIT_OK = 0
EXIT_SERVER_LOST = 3
EXIT_FAILED = 4

DTYPES = {"float64": torch.float64, "float32": torch.float32}

#: problem factories whose data can be cut to one client's samples (dataset + split)
_DATA_FACTORIES = ("logistic_regression", "least_squares")


class ClientOracle:
    """The :class:`~shrinkgrad.methods.GradientOracle` of one client, from a one-client problem.

    ``problem`` holds only client ``client``'s samples (n = 1); the oracle answers for the global
    id ``client`` and refuses any other, so a worker provably uses its own data only.
    """

    def __init__(self, problem: Problem, client: int) -> None:
        if problem.n != 1:
            raise ValueError(f"a client oracle needs a one-client problem, got n={problem.n}")
        self.problem = problem
        self.client = int(client)

    def _check(self, ids: torch.Tensor) -> None:
        if ids.numel() != 1 or int(ids[0]) != self.client:
            raise ValueError(
                f"worker of client {self.client} asked for the gradients of clients "
                f"{ids.tolist()}: it only holds its own data"
            )

    def grads(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self._check(ids)
        if not bool(torch.isfinite(x).all()):
            raise NonFiniteError("the model received from the server has non-finite entries")
        if x.ndim == 1:
            return self.problem.client_grads(x)
        return self.problem.client_grads_at(x)

    def stoch_grads(
        self, x: torch.Tensor, ids: torch.Tensor, batch_sizes: torch.Tensor, keys: Keys
    ) -> torch.Tensor:
        self._check(ids)
        if not bool(torch.isfinite(x).all()):
            raise NonFiniteError("the model received from the server has non-finite entries")
        return self.problem.client_stoch_grads(x, batch_sizes, keys)


def client_problem(config: PSConfig, client: int) -> Problem | None:
    """Client ``client``'s own problem (its samples only), or None when it cannot be cut out.

    For the dataset-based problems (logistic regression, least squares) the split of the full
    problem is resolved and the factory is called with the explicit one-client split, which
    gives bit-for-bit the full problem's ∇f_client (same rows, same order, same weights).
    """
    from ...problems.base import PROBLEMS
    from ...problems.datasets import load
    from ...problems.splits import ExplicitSplit, resolve_split

    spec = parse_spec(config.problem_spec())
    params = dict(spec.params)
    if spec.name not in _DATA_FACTORIES or "dataset" not in params:
        return None
    factory = PROBLEMS.entry(spec.name).factory
    split = params.get("split", inspect.signature(factory).parameters["split"].default)
    data = load(params["dataset"], n_features=params.get("n_features"))
    parts, _ = resolve_split(split, data, int(params["n_clients"]))
    rest = tuple((k, v) for k, v in params.items() if k not in ("split", "n_clients"))
    problem = PROBLEMS.make(
        str(Spec(spec.name, rest, spec.args)), split=ExplicitSplit([parts[client]])
    )
    return problem


def client_oracle(
    config: PSConfig, client: int, full: Problem | None = None
) -> tuple[GradientOracle, int]:
    """Worker ``client``'s gradient oracle and the dimension d.

    Uses :func:`client_problem` when possible; otherwise the full problem (``full``, or built
    from the spec) through :class:`~shrinkgrad.methods.ProblemOracle` (correct, but every
    gradient then costs a pass over all clients' data).
    """
    own = client_problem(config, client)
    if own is not None:
        return ClientOracle(own, client), own.d
    if full is None:
        from ...problems import make_problem

        full = make_problem(config.problem_spec())
    return ProblemOracle(full), full.d


def _fail(rank: int, text: str) -> None:
    print(f"shrinkgrad ps worker (rank {rank}): {text}", file=sys.stderr, flush=True)


def _short(e: BaseException) -> str:
    msg = str(e)
    for key, text in (
        ("Connection closed by peer", "connection closed by the server"),
        ("Connection reset by peer", "connection reset by the server"),
        ("Timed out", "timed out waiting for the server"),
    ):
        if key in msg:
            return text
    return f"{type(e).__name__}: {msg.splitlines()[0][:160] if msg else ''}"


def run_worker(config: PSConfig, client: int, oracle: GradientOracle, d: int) -> int:
    """The worker loop of client ``client`` (rank ``client + 1``); returns the exit status."""
    rank = client + 1
    dtype, wire = DTYPES[config.dtype], DTYPES[config.wire_dtype]
    C = make_compressor(config.compressor)
    ids = torch.tensor([client], dtype=torch.int64)
    ckeys = KeyStream(config.seed, ids, stream="compressor")
    mkeys = KeyStream(config.seed, ids, stream="minibatch")
    batch = None if config.batch_size is None else torch.tensor([config.batch_size])
    buf = model_message(d, dtype)
    wait = datetime.timedelta(seconds=2.0 * config.timeout)
    budget = config.worker_delay(client)
    kill_after = config.kill_workers.get(client)
    k = config.first_counter
    sent = 0
    while True:
        try:
            recv(buf, 0, wait)
        except RuntimeError as e:
            _fail(rank, f"server lost ({_short(e)}); exiting")
            return EXIT_SERVER_LOST
        kind, version, x = unpack_model(buf, dtype)
        if kind == STOP:
            return EXIT_OK
        if kind != MODEL:
            _fail(rank, f"unknown message kind {kind} from the server; exiting")
            return EXIT_FAILED
        start = time.perf_counter()
        try:
            if batch is None:
                g = oracle.grads(x, ids)
            else:
                g = oracle.stoch_grads(x, ids, batch, mkeys.at(k))
            keys = None if C.deterministic else ckeys.at(k)[0]
            payload = C.encode(g[0].to(wire), keys)
        except Exception as e:  # report to the server, then exit
            text = f"{type(e).__name__}: {e}".encode()[:4000]
            _fail(rank, f"failed computing message {k}: {type(e).__name__}: {e}")
            try:
                send(grad_header(FAIL, k, version, len(text)), 0, wait)
                send(torch.frombuffer(bytearray(text), dtype=torch.uint8), 0, wait)
            except RuntimeError:
                pass
            return EXIT_FAILED
        rest = budget - (time.perf_counter() - start)
        if rest > 0:
            time.sleep(rest)
        try:
            send(grad_header(GRAD, k, version, payload.numel()), 0, wait)
            if payload.numel():
                send(payload, 0, wait)
        except RuntimeError as e:
            _fail(rank, f"server lost ({_short(e)}); exiting")
            return EXIT_SERVER_LOST
        k += 1
        sent += 1
        if kill_after is not None and sent >= kill_after:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # fault injection: die without any cleanup
