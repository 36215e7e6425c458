"""The worker side of the parameter server: its client's data and the method's client step.

Worker i (rank i + 1) holds client i's data only (:func:`client_oracle`:
:meth:`~shrinkgrad.problems.Problem.restrict`). Its loop ([K18], the asynchronous parameter
server) runs the method's own client part (:func:`~shrinkgrad.methods.asynchronous.client_init`,
:func:`~shrinkgrad.methods.asynchronous.client_update`) on its one client:

1. receive INIT (x⁰): the method's ``init_clients`` for client i (round 0), send what it sends;
2. receive MODEL (x^v, its version v), or RESUME (a client state restored by the server from its
   snapshot, the next counter k, and x^v), or STOP;
3. the method's ``client_step`` at x^v as round k (its keyed draws: compressor key (seed,
   "compressor", i, k), minibatch key (seed, "minibatch", i, k), ...) on the worker's client
   state; encode what it compressed with the compressor's wire format (``C.encode``, which the
   server decodes to exactly the vector the client step used);
4. wait until ``delay × speeds[i]`` seconds have passed since step 3 began (artificial speed);
5. send (k, v, payload, the method's bit count); k ← k + 1.

So a one-worker run is the sequential method step for step (tests/distributed/test_ps_run.py). A
worker whose server disappears (the connection closes, or it is silent for ``2·timeout``
seconds) prints one line and exits with :data:`EXIT_SERVER_LOST`.
"""

from __future__ import annotations

import datetime
import io
import os
import signal
import sys
import time
from typing import Any

import torch

from ...methods.asynchronous import MinibatchOracle, Sent, client_init, client_update
from ...methods.base import Config, GradientOracle, Method
from ...problems import Problem
from ..runner import LocalOracle
from .config import PSConfig
from .wire import (
    FAIL,
    GRAD,
    INIT,
    MODEL,
    RESUME,
    STOP,
    encode_payload,
    model_message,
    recv,
    reply_header,
    send,
    unpack_model,
)

__all__ = [
    "DTYPES",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_SERVER_LOST",
    "client_oracle",
    "dump_clients",
    "load_clients",
    "run_worker",
]

#: a worker's exit status: stopped by the server / lost its server / failed computing
EXIT_OK = 0
EXIT_SERVER_LOST = 3
EXIT_FAILED = 4

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def client_oracle(problem: Problem, client: int) -> LocalOracle:
    """Worker ``client``'s gradient oracle: the problem cut to its client
    (:meth:`~shrinkgrad.problems.Problem.restrict`, bit for bit the full problem's ∇f_client),
    or, for a problem that cannot be cut (``restrict`` returns None), the full problem keeping
    the client's row (correct, but every gradient costs a pass over all clients; the launcher
    says so)."""
    return LocalOracle(problem, torch.tensor([client], dtype=torch.int64))


def dump_clients(clients: Any) -> torch.Tensor:
    """A client state as bytes (RESUME's payload)."""
    buf = io.BytesIO()
    torch.save(clients, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def load_clients(payload: torch.Tensor) -> Any:
    """Inverse of :func:`dump_clients` (the server is trusted: it is this run's own process)."""
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)


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


class _ServerLost(Exception):
    """The connection to the server failed (its text says how)."""


def run_worker(
    config: PSConfig, client: int, oracle: GradientOracle, method: Method[Any, Any], cfg: Config
) -> int:
    """The worker loop of client ``client`` (rank ``client + 1``); returns the exit status.

    ``method`` is the method's asynchronous form (``async_form()``), ``cfg`` its bound
    configuration (the server's: the same step size, weights, compressor and seed)."""
    rank = client + 1
    dtype = DTYPES[config.dtype]
    ids = torch.tensor([client], dtype=torch.int64)
    buf = model_message(cfg.d, dtype)
    wait = datetime.timedelta(seconds=2.0 * config.timeout)
    budget = config.worker_delay(client)
    kill_after = config.kill_workers.get(client)
    batch = config.batch_size
    clients: Any = None
    k = 0
    sent_count = 0

    def receive(tensor: torch.Tensor) -> None:
        try:
            recv(tensor, 0, wait)
        except RuntimeError as e:
            raise _ServerLost(_short(e)) from None

    def reply(kind: int, version: int, sent: Sent) -> None:
        payload_kind, payload = encode_payload(sent, cfg, client)
        traffic = tuple(float(t[0]) for t in sent.traffic)
        header = reply_header(
            kind,
            k,
            version,
            payload.numel(),
            payload_kind,
            sent.round,
            traffic,  # type: ignore[arg-type]
        )
        try:
            send(header, 0, wait)
            if payload.numel():
                send(payload, 0, wait)
        except RuntimeError as e:
            raise _ServerLost(_short(e)) from None

    try:
        while True:
            receive(buf)
            kind, version, counter, nbytes, x = unpack_model(buf, dtype)
            if kind == STOP:
                return EXIT_OK
            if kind == RESUME:
                state = torch.empty(nbytes, dtype=torch.uint8)
                receive(state)
                clients, k = load_clients(state), counter
            elif kind not in (INIT, MODEL):
                _fail(rank, f"unknown message kind {kind} from the server; exiting")
                return EXIT_FAILED
            start = time.perf_counter()
            round_oracle = oracle if batch is None else MinibatchOracle(oracle, batch, cfg.seed, k)
            try:
                if kind == INIT:
                    clients, sent = client_init(method, cfg, x, round_oracle, ids)
                else:
                    clients, sent = client_update(method, cfg, x, clients, round_oracle, k)
            except Exception as e:  # report to the server, then exit
                text = f"{type(e).__name__}: {e}".encode()[:4000]
                _fail(rank, f"failed computing message {k}: {type(e).__name__}: {e}")
                try:
                    send(reply_header(FAIL, k, version, len(text)), 0, wait)
                    send(torch.frombuffer(bytearray(text), dtype=torch.uint8), 0, wait)
                except RuntimeError:
                    pass
                return EXIT_FAILED
            if sent.kind != "none":
                rest = budget - (time.perf_counter() - start)
                if rest > 0:
                    time.sleep(rest)
            reply(INIT if kind == INIT else GRAD, version, sent)
            k += 1
            if sent.kind != "none":
                sent_count += 1
            if kill_after is not None and sent_count >= kill_after:
                sys.stdout.flush()
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)  # fault injection: die without any cleanup
    except _ServerLost as e:
        _fail(rank, f"server lost ({e}); exiting")
        return EXIT_SERVER_LOST
