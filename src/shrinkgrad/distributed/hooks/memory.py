"""The hook's memory: the method state of every tensor, its snapshot (overflows) and checkpoints.

A tensor's error-feedback memory *is* the method's state for that tensor (design.md principle
13): a :class:`~shrinkgrad.methods.State` (round, server part, client part of this rank), keyed by
the tensor's canonical id. For checkpoints a state is flattened into plain tensors named by their
path (``server.g``, ``clients.g``, ``clients.v``, ``clients.inner.g``, ...); the fields the hook
owns are left out: ``server.x`` (the zero displacement) and the ``ids`` (this rank). A loaded
state is rebuilt when its tensor is first planned, on a template from the method's own
initialisation, so a checkpoint holds nothing but tensors and numbers (``torch.load`` with
``weights_only=True`` reads it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...methods.base import State
from .plan import Unit, bucket_label

__all__ = ["STATE_FORMAT", "Memory"]

#: format tag of :meth:`CompressionState.state_dict <shrinkgrad.distributed.CompressionState>`
STATE_FORMAT = "shrinkgrad.distributed.CompressionState/2"
_OLD_FORMAT = "shrinkgrad.distributed.CompressionState/1"


def _skipped(path: str) -> bool:
    """The hook's own fields: the zero displacement ``server.x`` and every ``ids`` (this rank)."""
    return path == "server.x" or path.endswith(".ids")


#: ``template(uid) -> State``: a state of the right structure for the tensor ``uid``
Template = Callable[[int], State[Any, Any]]


def _is_tuple(v: Any) -> bool:
    return isinstance(v, tuple) and hasattr(v, "_fields")


def _leaves(prefix: str, value: Any) -> Iterator[tuple[str, Any]]:
    if _is_tuple(value):
        for name in value._fields:
            yield from _leaves(f"{prefix}.{name}", getattr(value, name))
    elif not _skipped(prefix):
        yield prefix, value


def _replace_tensor(value: Any, old: torch.Tensor, new: torch.Tensor) -> Any:
    """``value`` (a NamedTuple tree) with its leaf that is the tensor ``old`` (same memory,
    shape and dtype) replaced by ``new`` viewed in its shape; ``value`` itself when none is."""
    if _is_tuple(value):
        fields = {name: getattr(value, name) for name in value._fields}
        changed = {k: _replace_tensor(v, old, new) for k, v in fields.items()}
        if all(changed[k] is fields[k] for k in fields):
            return value
        return value._replace(**changed)
    if (
        isinstance(value, torch.Tensor)
        and value.data_ptr() == old.data_ptr()
        and value.shape == old.shape
        and value.dtype == old.dtype
    ):
        return new.view(value.shape)
    return value


def flatten(state: State[Any, Any]) -> dict[str, Any]:
    """The saved leaves of a state: ``{path: tensor or number}``."""
    return dict(_leaves("server", state.server)) | dict(_leaves("clients", state.clients))


def _fill(prefix: str, template: Any, saved: dict[str, Any], where: str) -> Any:
    if _is_tuple(template):
        return template._replace(
            **{
                name: _fill(f"{prefix}.{name}", getattr(template, name), saved, where)
                for name in template._fields
            }
        )
    if _skipped(prefix):
        return template
    if prefix not in saved:
        raise ValueError(f"{where}: the checkpoint lacks {prefix!r}")
    value = saved[prefix]
    if isinstance(template, torch.Tensor):
        if not isinstance(value, torch.Tensor) or value.shape != template.shape:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"{where}: {prefix!r} has shape {shape} in the checkpoint but "
                f"{tuple(template.shape)} in this model"
            )
        if value.dtype != template.dtype:  # copy_ would cast silently
            raise ValueError(
                f"{where}: {prefix!r} is {str(value.dtype).removeprefix('torch.')} in the "
                f"checkpoint but {str(template.dtype).removeprefix('torch.')} in this model (the "
                "model's dtype changed since the checkpoint; load it into a model of the dtype it "
                "was saved from)"
            )
        return template.copy_(value)
    return value


def _split_leaf(name: str, value: Any, numel: int) -> bool:
    """Whether a bucket unit's leaf is split between its parameters: a tensor along the
    bucket (last dimension ``numel``); every other leaf is the same for all of them."""
    return (
        isinstance(value, torch.Tensor)
        and value.ndim >= 1
        and value.shape[-1] == numel
        and not name.endswith("compressor_state")
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    return bool(a == b)


Entry = tuple[int, dict[str, Any]]  # (round, leaves)


class Memory:
    """Method states by unit id, with the snapshot that undoes an overflowing iteration.

    A unit is one parameter's gradient, or with ``granularity="bucket"`` a whole bucket
    (:attr:`groups`: its parameters). A bucket unit's state is split into its parameters'
    entries for checkpoints (so a checkpoint is one entry per parameter at either granularity)
    and whenever DDP regroups those parameters (its bucket rebuild after the first iteration):
    a new bucket unit is then joined from its parameters' entries — the error-feedback memory
    follows the parameters, entry for entry.
    """

    def __init__(self, template: Template) -> None:
        self._template = template
        self.states: dict[int, State[Any, Any]] = {}
        #: per-parameter entries not in a state yet, built into one when their unit is first
        #: planned: loaded from a checkpoint, or split from a bucket unit whose parameters DDP
        #: regrouped
        self.pending: dict[int, Entry] = {}
        #: the parameters of every bucket unit: unit id → ((parameter id, numel), ...)
        self.groups: dict[int, tuple[tuple[int, int], ...]] = {}
        self._backup: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
        #: since the last snapshot: the pending entries each new state was built from, put back
        #: when :meth:`restore` drops that state (only kept once snapshots are taken)
        self._consumed: dict[int, list[tuple[int, Entry]]] = {}
        self._snapshots = False

    def get(self, uid: int) -> State[Any, Any] | None:
        state = self.states.get(uid)
        if state is not None:
            return state
        members = self.groups.get(uid)
        if members is not None:
            entry = self._join(uid, members)
            if entry is None:
                return None
            where = f"the hook state of {bucket_label(members)}"
        elif uid in self.pending:
            entry = self.pending.pop(uid)
            if self._snapshots:
                self._consumed[uid] = [(uid, entry)]
            where = f"the hook state of tensor #{uid}"
        else:
            return None
        round_, saved = entry
        t = self._template(uid)
        state = State(
            round_,
            _fill("server", t.server, saved, where),
            _fill("clients", t.clients, saved, where),
        )
        extra = sorted(set(saved) - set(flatten(state)))
        if extra:
            raise ValueError(f"{where}: the checkpoint has {extra}, which this method lacks")
        self.states[uid] = state
        return state

    # -- bucket units ---------------------------------------------------------------------------
    def _pieces(self, uid: int, state: State[Any, Any]) -> dict[int, Entry]:
        """A bucket unit's state as its parameters' entries (views, no copies)."""
        members = self.groups[uid]
        numel = sum(n for _, n in members)
        leaves = flatten(state)
        out: dict[int, Entry] = {}
        offset = 0
        for m, n in members:
            out[m] = (
                state.round,
                {
                    name: v[..., offset : offset + n] if _split_leaf(name, v, numel) else v
                    for name, v in leaves.items()
                },
            )
            offset += n
        return out

    def _join(self, uid: int, members: tuple[tuple[int, int], ...]) -> Entry | None:
        """The entry of a new bucket unit from its parameters' entries (None: none has one;
        its method then initialises it). The live bucket units holding any of its parameters
        are split into entries first: DDP regrouped them."""
        ids = [m for m, _ in members]
        label = bucket_label(members)
        wanted = set(ids)
        for other, held in list(self.groups.items()):
            if other != uid and other in self.states and wanted & {m for m, _ in held}:
                self.pending.update(self._pieces(other, self.states.pop(other)))
        have = [m for m in ids if m in self.pending]
        if not have:
            return None
        if len(have) != len(ids):
            lack = [m for m in ids if m not in self.pending]
            raise RuntimeError(
                f"the hook state holds some tensors of {label} but not {lack}: the checkpoint "
                "belongs to another model (or another parameter order)"
            )
        entries = [self.pending.pop(m) for m in ids]
        if self._snapshots:
            self._consumed[uid] = list(zip(ids, entries, strict=True))
        rounds = {r for r, _ in entries}
        if len(rounds) > 1:
            raise RuntimeError(
                f"the tensors of {label} have method states of different rounds "
                f"{sorted(rounds)}: they cannot be joined into one bucket unit"
            )
        names = set(entries[0][1])
        if any(set(e) != names for _, e in entries):
            raise RuntimeError(f"the tensors of {label} have method states of other structures")
        joined: dict[str, Any] = {}
        for name in sorted(names):
            values = [e[name] for _, e in entries]
            if all(_split_leaf(name, v, n) for v, (_, n) in zip(values, members, strict=True)):
                joined[name] = torch.cat(values, dim=-1)
            elif all(_same(v, values[0]) for v in values[1:]):
                joined[name] = values[0]
            else:
                raise RuntimeError(
                    f"the tensors of {label} differ in {name!r}, which is not "
                    "per-entry state: they cannot be joined into one bucket unit"
                )
        return rounds.pop(), joined

    def put(self, uid: int, state: State[Any, Any]) -> None:
        self.states[uid] = state

    def holds(self, uid: int, t: torch.Tensor) -> bool:
        """Whether a server-state tensor of ``uid`` lives in ``t``'s memory (the plan's output,
        after :meth:`rebind`)."""
        state = self.states.get(uid)
        if state is None:
            return False
        ptr = t.data_ptr()
        return any(
            isinstance(v, torch.Tensor) and v.data_ptr() == ptr
            for v in dict(_leaves("server", state.server)).values()
        )

    def rebind(self, uid: int, old: torch.Tensor, new: torch.Tensor) -> None:
        """The server-state tensor of ``uid`` that *is* ``old`` becomes ``new`` (which holds the
        same values: the hook has just copied them): a direction that is part of the method's
        state (EF21's g) then lives in the output DDP reads, and later iterations update it
        there in place instead of copying it. Nothing happens when no server tensor is ``old``."""
        state = self.states.get(uid)
        if state is None:
            return
        server = _replace_tensor(state.server, old, new)
        if server is not state.server:
            self.states[uid] = State(state.round, server, state.clients)

    def check(self, u: Unit) -> None:
        """A planned unit against the memory kept (or loaded) for it: same sizes (a bucket
        unit: its parameters' entries)."""
        state = self.states.get(u.uid)
        if state is not None:
            _check_leaves(flatten(state), u.numel, u.label)
            return
        for m, n in u.members or ((u.uid, u.numel),):
            if m in self.pending:
                _check_leaves(self.pending[m][1], n, f"tensor #{m}")

    # -- overflows ------------------------------------------------------------------------------
    def snapshot(self) -> None:
        """Copy every state into the backup (buffers reused from the previous snapshot)."""
        self._snapshots = True
        self._consumed = {}
        backup: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
        for uid, state in self.states.items():
            old = self._backup.get(uid, (0, {}))[1]
            saved: dict[str, torch.Tensor] = {}
            for name, t in flatten(state).items():
                if not isinstance(t, torch.Tensor):
                    continue
                b = old.get(name)
                if b is None or b.shape != t.shape or b.dtype != t.dtype or b.device != t.device:
                    b = torch.empty_like(t)
                saved[name] = b.copy_(t)
            backup[uid] = (state.round, saved)
        self._backup = backup

    def restore(self) -> None:
        """The states as at the last snapshot: states created since are dropped, and the
        pending entries they were built from (a checkpoint's, or a regrouped bucket unit's,
        untouched since) are pending again."""
        for uid in list(self.states):
            if uid not in self._backup:
                del self.states[uid]
                self.pending.update(self._consumed.get(uid, []))
                continue
            round_, saved = self._backup[uid]
            state = self.states[uid]
            for name, t in flatten(state).items():
                if name in saved:
                    t.copy_(saved[name])
            self.states[uid] = State(round_, state.server, state.clients)
        self._consumed = {}

    # -- checkpoints ----------------------------------------------------------------------------
    def to_dict(self) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        for uid, (round_, saved) in self.pending.items():
            out[uid] = {"round": round_, "state": {k: _cpu(v) for k, v in saved.items()}}
        for uid, state in self.states.items():
            pieces = (
                self._pieces(uid, state)
                if uid in self.groups
                else {uid: (state.round, flatten(state))}
            )
            for m, (round_, leaves) in pieces.items():
                out[m] = {"round": round_, "state": {k: _cpu(v) for k, v in leaves.items()}}
        return dict(sorted(out.items()))

    def load(self, memory: dict[Any, dict[str, Any]]) -> None:
        self.states = {}
        self._backup = {}
        self._consumed = {}
        self.pending = {
            int(uid): (int(entry["round"]), {k: _cpu(v) for k, v in entry["state"].items()})
            for uid, entry in memory.items()
        }

    @staticmethod
    def check_format(state: Any) -> None:
        if isinstance(state, dict) and state.get("format") == _OLD_FORMAT:
            raise ValueError(
                f"this hook checkpoint has the format {_OLD_FORMAT!r} of shrinkgrad before the "
                "hook ran registered methods; its memory cannot be mapped exactly onto the method "
                "states (the uncompressed tensors carry method state now): restore the model and "
                "the optimizer, and start the hook state afresh (it initialises in one dense "
                "iteration)"
            )
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(
                "not a CompressionState checkpoint (expected the dict of state_dict(), format "
                f"{STATE_FORMAT!r})"
            )


def _check_leaves(leaves: dict[str, Any], numel: int, label: str) -> None:
    for name, t in leaves.items():
        if name.endswith("compressor_state"):
            continue  # the compressor's own layout (empty, or PowerSGD's factor), not d
        if isinstance(t, torch.Tensor) and t.ndim >= 1 and t.shape[-1] != numel:
            raise ValueError(
                f"the error-feedback state {name!r} of {label} has {t.shape[-1]} entries but the "
                f"model's gradient has {numel}: the checkpoint belongs to another model (or "
                "another parameter order)"
            )


def _cpu(v: Any) -> Any:
    return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
