"""Message formats of the parameter server (torch.distributed point-to-point on gloo).

All messages are ``uint8`` or ``int64`` tensors; integers are little-endian int64 words (the host
order of every platform torch's gloo runs on).

Server → worker, one message of ``HEADER_BYTES + d·itemsize`` bytes::

    int64 kind      INIT (compute the initial message at x⁰), MODEL (compute the next message
                    at this model), RESUME (restart from a snapshot: a client-state payload of
                    ``nbytes`` bytes follows, then compute at this model) or STOP (exit)
    int64 version   the server version t of x^t (the number of updates applied so far)
    int64 counter   RESUME: the worker's next message counter; else 0
    int64 nbytes    RESUME: the size of the client state that follows; else 0
    x               d values in the run dtype (float64 by default: exactly the server's x)

Worker → server, a fixed-size header then (when ``nbytes > 0``) a payload of ``nbytes`` bytes::

    int64 kind      INIT (the initial message), GRAD (a step's message) or FAIL (the worker
                    failed; payload = UTF-8 text)
    int64 counter   the worker's message counter k (its round: 0 for INIT)
    int64 version   the model version the message was computed at
    int64 nbytes    payload length
    int64 payload   NONE, COMPRESSED or DENSE (:class:`~shrinkgrad.methods.asynchronous.Sent`)
    int64 key       the round of the compressor key the payload was encoded with
    float64 × 3     the method's bit count of the message: up, up (papers' convention), down
    payload         COMPRESSED: the compressor's wire format ``C.encode(v, keys)`` of
                    :mod:`shrinkgrad.compressors` (values, indices, norms bit-packed; exactly
                    ⌈bits/8⌉ bytes), decoded by the server with the same keys; DENSE: the
                    message's d values in the wire dtype

The headers are protocol overhead and are not counted in the bits, which are the method's own
count of its messages, as in the simulator (docs/parameter_server.md, "Bits").
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ...methods.asynchronous import Sent
from ...methods.base import Config, Traffic
from ...rng import Keys

__all__ = [
    "COMPRESSED",
    "DENSE",
    "FAIL",
    "GRAD",
    "HEADER_BYTES",
    "HEADER_WORDS",
    "INIT",
    "MODEL",
    "NONE",
    "REPLY_WORDS",
    "RESUME",
    "STOP",
    "decode_payload",
    "encode_payload",
    "model_message",
    "pack_model",
    "read_reply",
    "recv",
    "reply_header",
    "send",
    "unpack_model",
]

HEADER_WORDS = 4
HEADER_BYTES = 8 * HEADER_WORDS
#: words of the worker → server header
REPLY_WORDS = 9

#: server -> worker kinds
INIT = 4
MODEL = 1
STOP = 2
RESUME = 5
#: worker -> server kinds (INIT as above)
GRAD = 1
FAIL = 3
#: payload kinds
NONE = 0
COMPRESSED = 1
DENSE = 2
_PAYLOAD = {"none": NONE, "compressed": COMPRESSED, "dense": DENSE}


def model_message(d: int, dtype: torch.dtype) -> torch.Tensor:
    """A preallocated server→worker buffer for a model of ``d`` values of ``dtype``."""
    itemsize = torch.finfo(dtype).bits // 8
    return torch.zeros(HEADER_BYTES + d * itemsize, dtype=torch.uint8)


def pack_model(
    buf: torch.Tensor,
    kind: int,
    version: int,
    x: torch.Tensor | None,
    *,
    counter: int = 0,
    nbytes: int = 0,
) -> torch.Tensor:
    """Write an INIT/MODEL/RESUME (with ``x``) or STOP message into ``buf``."""
    header = buf[:HEADER_BYTES].view(torch.int64)
    header[0], header[1], header[2], header[3] = kind, version, counter, nbytes
    if x is not None:
        body = buf[HEADER_BYTES:]
        if body.numel() != x.numel() * x.element_size():
            raise ValueError(
                f"model of {x.numel()} {x.dtype} values does not fit a {body.numel()}-byte body"
            )
        body.copy_(x.contiguous().view(torch.uint8))
    return buf


def unpack_model(buf: torch.Tensor, dtype: torch.dtype) -> tuple[int, int, int, int, torch.Tensor]:
    """(kind, version, counter, nbytes, x) of a server→worker message; ``x`` views ``buf``."""
    header = buf[:HEADER_BYTES].view(torch.int64)
    kind, version, counter, nbytes = (int(v) for v in header.tolist())
    return kind, version, counter, nbytes, buf[HEADER_BYTES:].view(dtype)


def reply_header(
    kind: int,
    counter: int,
    version: int,
    nbytes: int,
    payload: int = NONE,
    key: int = 0,
    traffic: tuple[float, float, float] = (0.0, 0.0, 0.0),
) -> torch.Tensor:
    """The worker→server header."""
    header = torch.zeros(REPLY_WORDS, dtype=torch.int64)
    header[:6] = torch.tensor([kind, counter, version, nbytes, payload, key])
    header[6:].view(torch.float64)[:] = torch.tensor(traffic, dtype=torch.float64)
    return header


def read_reply(header: torch.Tensor) -> tuple[int, int, int, int, int, int, Traffic]:
    """(kind, counter, version, nbytes, payload kind, key round, traffic) of a reply header."""
    kind, counter, version, nbytes, payload, key = (int(v) for v in header[:6].tolist())
    up, paper, down = (t.reshape(1) for t in header[6:].view(torch.float64).clone())
    return kind, counter, version, nbytes, payload, key, Traffic(up, paper, down)


def _key(cfg: Config, client: int, round: int) -> Keys | None:
    """The key of ``client``'s compressor draw at ``round``: the method's own
    (``Config.keys``), so that a shared-seed draw is the one every client made."""
    if cfg.compressor.deterministic:
        return None
    return cfg.keys("compressor", torch.tensor([client], dtype=torch.int64), round)[0]


def encode_payload(sent: Sent, cfg: Config, client: int) -> tuple[int, torch.Tensor]:
    """(payload kind, bytes) of one client's :class:`Sent` (``cfg``: the bound method's)."""
    kind = _PAYLOAD[sent.kind]
    if sent.raw is None:
        return kind, torch.empty(0, dtype=torch.uint8)
    raw = sent.raw[0].contiguous()
    if kind == COMPRESSED:
        return kind, cfg.compressor.encode(raw, _key(cfg, client, sent.round))
    return kind, raw.view(torch.uint8).clone()


def decode_payload(
    kind: int,
    payload: torch.Tensor,
    cfg: Config,
    client: int,
    key_round: int,
    d: int,
    wire_dtype: torch.dtype,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """The vector (1, d) in the run dtype that the payload carries, or None (nothing sent)."""
    if kind == NONE:
        return None
    if kind == COMPRESSED:
        v = cfg.compressor.decode(payload, d, wire_dtype, _key(cfg, client, key_round))
    elif kind == DENSE:
        v = payload.view(wire_dtype)
        if v.numel() != d:
            raise ValueError(f"a dense message of {v.numel()} values, expected d={d}")
    else:
        raise ValueError(f"unknown payload kind {kind}")
    return v.to(dtype).reshape(1, d)


def send(tensor: torch.Tensor, dst: int, timeout: datetime.timedelta) -> None:
    """Send ``tensor`` to rank ``dst`` and wait at most ``timeout`` (RuntimeError on failure)."""
    work = dist.isend(tensor, dst=dst)
    if work is None:
        raise RuntimeError(f"rank {dst} is not in the process group")
    work.wait(timeout)


def recv(tensor: torch.Tensor, src: int, timeout: datetime.timedelta) -> None:
    """Receive into ``tensor`` from rank ``src``, waiting at most ``timeout`` (RuntimeError)."""
    work = dist.irecv(tensor, src=src)
    if work is None:
        raise RuntimeError(f"rank {src} is not in the process group")
    work.wait(timeout)
