"""Train an MLP on a bundled LIBSVM dataset with DDP and a shrinkgrad communication hook.

Run it with torchrun (any number of processes, gloo on CPU or NCCL on GPUs)::

    torchrun --standalone --nproc-per-node 4 examples/ddp_mlp.py \
        --hook shrinkgrad --compressor top_k --ratio 0.01 --method ef21

or, on one machine without torchrun (forked gloo processes on 127.0.0.1)::

    python examples/ddp_mlp.py --nproc 4 --hook shrinkgrad --compressor top_k --ratio 0.01

``--method`` is any method that runs in a DDP hook (``shrinkgrad list methods``: ef21, ef21_w,
ef, dcgd, gd, ...); with ``--client-momentum`` (the default) the momentum sits on the ranks
(ef21 becomes ef21_sgdm). ``--ratio`` (default 0.01) applies to the compressors with a ``k``
parameter (top_k, rand_k, ...) named without one; other compressors (qsgd, natural, ...) take
none. ``--hook none`` is DDP's dense all-reduce, ``--hook fp16`` torch's fp16_compress_hook and
``--hook powersgd`` torch's powerSGD_hook (rank 4; with ``--bucket-cap-mb 1000`` on gloo), for
comparison; shrinkgrad's PowerSGD is ``--compressor power_sgd[rank=4,shared=true]``. On this
task at 100 Mbit/s the fastest to fp16's final test loss was ``--method ef
--no-client-momentum`` (top_k 1% with classic error feedback and the optimizer's momentum,
as torch's PowerSGD runs EF; docs/distributed.md §4.2a). Logged
times leave out the logging itself (the evaluations). ``--amp`` trains in float16 mixed
precision (autocast + ``torch.amp.GradScaler``, which the shrinkgrad state is given so that
overflowing steps are skipped on every rank).

Every ``--log-every`` steps rank 0 prints the training loss (the average of the ranks' minibatch
losses), the test loss and accuracy, and the bytes the ranks handed to the collectives so far
(all ranks together) next to what dense float32 all-reduces would have sent.

The data: the dataset's rows are split once into train and test (``--test-fraction``, seeded);
rank r trains on the train rows r, r + W, r + 2W, ... with its own minibatch order. The only
shrinkgrad-specific lines are the two that create the state and register the hook.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from shrinkgrad.compressors.ratio import ratio_spec
from shrinkgrad.distributed import (
    CompressionState,
    WorkerError,
    compression_hook,
    init_from_env,
    spawn,
    worker_setup,
)
from shrinkgrad.problems import load
from shrinkgrad.registry import SpecError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dataset", default="a9a", help="a bundled LIBSVM dataset (a9a, w8a, ...)")
    p.add_argument("--hidden", type=int, default=256, help="width of the two hidden layers")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps")
    p.add_argument("--batch", type=int, default=64, help="minibatch per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument(
        "--hook", choices=["none", "fp16", "powersgd", "shrinkgrad"], default="shrinkgrad"
    )
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=25.0,
        help="DDP's bucket size (torch's powerSGD_hook hangs on gloo with several buckets: 1000)",
    )
    p.add_argument("--compressor", default="top_k", help="a shrinkgrad compressor name")
    p.add_argument(
        "--ratio",
        type=float,
        default=None,
        help="k/d for compressors with a k parameter (top_k, rand_k, ...; default 0.01 for "
        "those, 0: none); other compressors take none",
    )
    p.add_argument(
        "--method",
        default="ef21",
        help="a method that runs in a DDP hook: ef21, ef21_w, ef, dcgd, ef21_sgdm[beta=...], ...",
    )
    p.add_argument(
        "--client-momentum",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="shrinkgrad: the momentum on the ranks, before compression (with EF21: EF21-SGDM), "
        "instead of in the optimizer; the same dynamics for an exact compressor",
    )
    p.add_argument(
        "--granularity",
        choices=["tensor", "bucket"],
        default="tensor",
        help="shrinkgrad's unit of compression: every parameter's gradient, or every DDP bucket "
        "as one vector (one compressor call per bucket)",
    )
    p.add_argument(
        "--amp",
        action="store_true",
        help="float16 autocast with torch.amp.GradScaler (passed to the shrinkgrad state)",
    )
    p.add_argument("--test-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--nproc", type=int, default=0, help="fork N local ranks (without torchrun)")
    p.add_argument("--json", help="rank 0 writes the final metrics here")
    args = p.parse_args(argv)
    if args.ratio is None:
        args.ratio = default_ratio(args.compressor)
    return args


def default_ratio(compressor: str) -> float:
    """0.01 for a compressor with a ``k`` parameter named without one (top_k, rand_k, strat_k,
    also inside ``scaled(...)``), else 0 (qsgd, natural, ... have no k: a ratio would be
    refused). A name that is not understood raises its SpecError."""
    try:
        ratio_spec(compressor, 0.01)
    except SpecError:
        raise
    except ValueError:
        return 0.0
    return 0.01


def load_split(name: str, test_fraction: float, seed: int) -> tuple[torch.Tensor, ...]:
    """Dense float32 features, labels in {0, 1}, split into train and test (seeded)."""
    data = load(name)
    X = torch.from_numpy(data.X.toarray().astype(np.float32))
    y = torch.from_numpy((data.y > 0).astype(np.float32))
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = round(test_fraction * len(y))
    test, train = perm[:n_test], perm[n_test:]
    return X[train], y[train], X[test], y[test]


def make_model(d: int, hidden: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every rank (DDP broadcasts rank 0's)
    return torch.nn.Sequential(
        torch.nn.Linear(d, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1),
    )


@torch.no_grad()
def evaluate(model: torch.nn.Module, X: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(mean logistic loss, accuracy) on (X, y)."""
    logits = model(X).squeeze(1)
    loss = F.binary_cross_entropy_with_logits(logits, y).item()
    acc = ((logits > 0).float() == y).float().mean().item()
    return loss, acc


def train(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train on this rank (inside an initialised process group); returns rank 0's metrics."""
    Xtr, ytr, Xte, yte = load_split(args.dataset, args.test_fraction, args.seed)
    Xr, yr = Xtr[rank::world], ytr[rank::world]
    model = DDP(make_model(Xtr.shape[1], args.hidden, args.seed), bucket_cap_mb=args.bucket_cap_mb)
    device = Xr.device.type
    scaler = torch.amp.GradScaler(device, enabled=args.amp)
    state = None
    if args.hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.hook == "powersgd":  # torch's, rank 4 (its error feedback and warm start on)
        psgd = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2
        )
        model.register_comm_hook(psgd, powerSGD_hook.powerSGD_hook)
    elif args.hook == "shrinkgrad":
        # the two lines of shrinkgrad:
        state = CompressionState(
            args.compressor,
            ratio=args.ratio or None,
            method=args.method,
            seed=args.seed,
            momentum=args.momentum if args.client_momentum else 0.0,
            scaler=scaler if args.amp else None,
            granularity=args.granularity,
        )
        model.register_comm_hook(state, compression_hook)
    if state is not None and state.momentum > 0:
        # the momentum lives on the ranks (an average, not a sum): the same heavy-ball dynamics
        # as SGD(lr, momentum) for an exact compressor
        opt = torch.optim.SGD(model.parameters(), lr=args.lr / (1.0 - args.momentum))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    gen = torch.Generator().manual_seed(1000 + rank)
    order = torch.randperm(len(yr), generator=gen)
    pos = 0
    dense_bytes = 4 * sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    paused = 0.0  # seconds spent logging (the evaluations): not training time
    history = []
    running = torch.zeros(2)  # loss sum, count since the last log
    for step in range(1, args.steps + 1):
        if pos + args.batch > len(order):
            order, pos = torch.randperm(len(yr), generator=gen), 0
        idx = order[pos : pos + args.batch]
        pos += args.batch
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16, enabled=args.amp):
            logits = model(Xr[idx]).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logits.float(), yr[idx])
        scaler.scale(loss).backward()  # with amp off: loss.backward()
        scaler.step(opt)  # skips the step when a gradient overflowed
        scaler.update()
        running += torch.tensor([loss.item(), 1.0])
        if step % args.log_every == 0 or step == args.steps:
            t_log = time.perf_counter()
            sent = state.bytes_sent if state is not None else dense_bytes * step
            if args.hook == "fp16":
                sent = dense_bytes // 2 * step
            stats = torch.cat([running, torch.tensor([float(sent)])]).double()
            dist.all_reduce(stats)  # every rank's losses and bytes
            running.zero_()
            test_loss, test_acc = evaluate(model.module, Xte, yte)
            row = {
                "step": step,
                "train_loss": float(stats[0] / stats[1]),
                "test_loss": test_loss,
                "test_acc": test_acc,
                "bytes_sent": int(stats[2]),
                "dense_bytes": dense_bytes * step * world,
                "time_s": t_log - t0 - paused,
            }
            history.append(row)
            if rank == 0:
                print(
                    f"step {step:5d}  train loss {row['train_loss']:.4f}  test loss "
                    f"{test_loss:.4f}  test acc {test_acc:.4f}  sent {row['bytes_sent'] / 1e6:.2f} "
                    f"MB (dense fp32: {row['dense_bytes'] / 1e6:.2f} MB)  {row['time_s']:.1f} s",
                    flush=True,
                )
            paused += time.perf_counter() - t_log
    full_loss, full_acc = evaluate(model.module, Xtr, ytr)
    return {
        "history": history,
        "final_train_loss": full_loss,
        "final_train_acc": full_acc,
        "overflows": state.overflows if state is not None else 0,
    }


def _forked(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    return train(rank, world, args)


def main(argv: list[str] | None = None) -> None:
    try:
        args = parse_args(argv)
    except ValueError as e:  # e.g. an unknown compressor name
        raise SystemExit(f"error: {e}") from None
    if args.nproc:
        try:
            results = spawn(_forked, args.nproc, (args,), timeout=24 * 3600.0, pg_timeout=120.0)
        except WorkerError as e:  # e.g. a compressor that the error feedback cannot use
            raise SystemExit(f"error: {e}") from None
        out = results[0]
    else:
        worker_setup(int(os.environ.get("OMP_NUM_THREADS", "1")))
        rank, world = init_from_env(timeout=120.0)
        try:
            out = train(rank, world, args)
        except (ValueError, TypeError) as e:  # a configuration mistake: one line per rank
            raise SystemExit(f"error (rank {rank}): {e}") from None
        finally:
            dist.destroy_process_group()
        if rank != 0:
            return
    print(
        f"final training loss {out['final_train_loss']:.4f}, accuracy {out['final_train_acc']:.4f}"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
