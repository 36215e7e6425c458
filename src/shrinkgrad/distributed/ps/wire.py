"""Message formats of the parameter server (torch.distributed point-to-point on gloo).

All messages are ``uint8`` tensors; integers are little-endian int64 words (the host order of
every platform torch's gloo runs on).

Server → worker, one message of ``HEADER_BYTES + d·itemsize`` bytes::

    int64 kind      MODEL (compute at this model) or STOP (exit)
    int64 version   the server version t of x^t (the number of updates applied so far)
    int64 0, 0      reserved
    x               d values in the run dtype (float64 by default: exactly the server's x)

Worker → server, a fixed-size header then (when ``nbytes > 0``) a payload of ``nbytes`` bytes::

    int64 kind      GRAD (a compressed gradient) or FAIL (the worker failed; payload = UTF-8 text)
    int64 counter   the worker's message counter k (its keyed-randomness round)
    int64 version   the model version the gradient was computed at
    int64 nbytes    payload length
    payload         the compressor's wire format: ``C.encode(g, keys)`` of
                    :mod:`shrinkgrad.compressors` (values, indices, norms bit-packed; exactly
                    ⌈bits/8⌉ bytes), decoded by the server with the same keys

The headers (32 bytes) are protocol overhead and are not counted in ``bits_up``/``bits_down``,
which count the payloads (docs/parameter_server.md, "Bits").
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

__all__ = [
    "FAIL",
    "GRAD",
    "HEADER_BYTES",
    "HEADER_WORDS",
    "MODEL",
    "STOP",
    "grad_header",
    "model_message",
    "pack_model",
    "read_header",
    "recv",
    "send",
    "unpack_model",
]

HEADER_WORDS = 4
HEADER_BYTES = 8 * HEADER_WORDS

#: server -> worker kinds
MODEL = 1
STOP = 2
#: worker -> server kinds
GRAD = 1
FAIL = 3


def model_message(d: int, dtype: torch.dtype) -> torch.Tensor:
    """A preallocated server→worker buffer for a model of ``d`` values of ``dtype``."""
    itemsize = torch.finfo(dtype).bits // 8
    return torch.zeros(HEADER_BYTES + d * itemsize, dtype=torch.uint8)


def pack_model(buf: torch.Tensor, kind: int, version: int, x: torch.Tensor | None) -> torch.Tensor:
    """Write a MODEL (with ``x``) or STOP message into ``buf`` (from :func:`model_message`)."""
    header = buf[:HEADER_BYTES].view(torch.int64)
    header[0], header[1], header[2], header[3] = kind, version, 0, 0
    if x is not None:
        body = buf[HEADER_BYTES:]
        if body.numel() != x.numel() * x.element_size():
            raise ValueError(
                f"model of {x.numel()} {x.dtype} values does not fit a {body.numel()}-byte body"
            )
        body.copy_(x.contiguous().view(torch.uint8))
    return buf


def unpack_model(buf: torch.Tensor, dtype: torch.dtype) -> tuple[int, int, torch.Tensor]:
    """(kind, version, x) of a server→worker message; ``x`` is a view into ``buf``."""
    header = buf[:HEADER_BYTES].view(torch.int64)
    return int(header[0]), int(header[1]), buf[HEADER_BYTES:].view(dtype)


def grad_header(kind: int, counter: int, version: int, nbytes: int) -> torch.Tensor:
    """The worker→server header."""
    return torch.tensor([kind, counter, version, nbytes], dtype=torch.int64)


def read_header(header: torch.Tensor) -> tuple[int, int, int, int]:
    """(kind, counter, version, nbytes) of a worker→server header."""
    kind, counter, version, nbytes = (int(v) for v in header.tolist())
    return kind, counter, version, nbytes


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
