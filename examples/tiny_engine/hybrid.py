"""Incremental inference for hybrid models with explicit per-sequence state: how an engine threads
recurrent state through chunked prefill, decode, beams and prefix snapshots (the manager does not
hold recurrent state yet; this is the reference its slots must reproduce).

A ``SequenceState`` holds, per attention layer, the K/V of every position so far (contiguous arrays;
the paged engine keeps them in the manager's pages instead) and, per recurrent layer, one fixed-size
``RecurrentState`` that every step overwrites in place, as a kernel overwrites a live state slot.
``step`` runs a sequence's next tokens; ``fork`` copies a sequence (a new beam); ``snapshot`` copies
every recurrent state at the current position; ``resume`` builds a sequence from a snapshot and the
K/V of the positions before it (prefix reuse: K/V from the matched blocks, recurrent state copied
out of the snapshot, which is never written).

Snapshot positions: a recurrent state exists only at the end of a step, so a snapshot at a block
boundary ``p`` needs a step that ends exactly at ``p``. ``prefill`` cuts its chunks at multiples of
the snapshot interval for that. Recording a chunk-end state under a boundary position instead is the
bug class ``snapshot_error`` detects (the state is checked against the dense reference's state at
the recorded position).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import kv_cache_manager_v2 as kvm

from .model import Array, RecurrentState, TinyModel


def _copy_state(state: RecurrentState) -> RecurrentState:
    return RecurrentState(state.conv_state.copy(), state.ssm_state.copy())


@dataclass(frozen=True)
class Snapshot:
    """Every recurrent layer's state after exactly ``position`` tokens of a sequence."""

    position: int
    states: dict[int, RecurrentState]


class SequenceState:
    """One sequence's (one beam's) state between steps; starts before the first token."""

    def __init__(self, model: TinyModel) -> None:
        cfg = model.cfg
        self.model = model
        self.num_tokens = 0
        kv_shape = (0, cfg.num_kv_heads, cfg.head_dim)
        attention_layers = [i for i, spec in enumerate(cfg.layers) if spec.has_attention]
        self.keys: dict[int, Array] = {i: np.zeros(kv_shape) for i in attention_layers}
        self.values: dict[int, Array] = {i: np.zeros(kv_shape) for i in attention_layers}
        self.states: dict[int, RecurrentState] = {i: model.initial_state() for i in cfg.recurrent_layers}

    def step(self, tokens: Sequence[kvm.TokenIdExt]) -> Array:
        """Run the next ``tokens`` (a prefill chunk or a decode token); their logits ``[n, vocab]``."""
        if not tokens:
            raise ValueError("a step needs at least one token")
        model = self.model
        begin, end = self.num_tokens, self.num_tokens + len(tokens)
        pos = np.arange(begin, end)
        x = model.embed(tokens)
        for layer, spec in enumerate(model.cfg.layers):
            attn = rec = None
            if spec.has_attention:
                q, k, v = model.qkv(layer, x, pos)
                self.keys[layer] = np.concatenate([self.keys[layer], k])
                self.values[layer] = np.concatenate([self.values[layer], v])
                attn = model.attend(layer, q, pos, self.keys[layer], self.values[layer], np.arange(end))
            if spec.has_recurrence:
                slot = self.states[layer]
                rec, new = model.recurrent(layer, x, slot)
                np.copyto(slot.conv_state, new.conv_state)
                np.copyto(slot.ssm_state, new.ssm_state)
            x = model.finish_layer(layer, x, attn, rec)
        self.num_tokens = end
        return model.logits(x)

    def fork(self) -> SequenceState:
        """An independent copy (a beam fork: K/V and every recurrent state copied)."""
        other = SequenceState.__new__(SequenceState)
        other.model = self.model
        other.num_tokens = self.num_tokens
        other.keys = {i: k.copy() for i, k in self.keys.items()}
        other.values = {i: v.copy() for i, v in self.values.items()}
        other.states = {i: _copy_state(s) for i, s in self.states.items()}
        return other

    def snapshot(self) -> Snapshot:
        """A copy of every recurrent state, recorded at the current position."""
        return Snapshot(self.num_tokens, {i: _copy_state(s) for i, s in self.states.items()})


def resume(kv_source: SequenceState, snapshot: Snapshot) -> SequenceState:
    """A sequence at ``snapshot.position``: the K/V of the positions before it from ``kv_source`` (a
    sequence with the same tokens up to there, at least that long), the recurrent states copied from
    the snapshot."""
    if not 0 <= snapshot.position <= kv_source.num_tokens:
        raise ValueError(f"snapshot at {snapshot.position}: the K/V source has {kv_source.num_tokens} tokens")
    if set(snapshot.states) != set(kv_source.states):
        raise ValueError(f"snapshot layers {sorted(snapshot.states)} are not {sorted(kv_source.states)}")
    seq = kv_source.fork()
    p = snapshot.position
    seq.keys = {i: k[:p].copy() for i, k in seq.keys.items()}
    seq.values = {i: v[:p].copy() for i, v in seq.values.items()}
    seq.states = {i: _copy_state(s) for i, s in snapshot.states.items()}
    seq.num_tokens = p
    return seq


def chunk_bounds(begin: int, end: int, chunk_sizes: Sequence[int], snapshot_interval: int | None = None) -> list[int]:
    """Where the prefill steps of positions ``[begin, end)`` end: chunks of ``chunk_sizes`` in order (the
    last size repeats), each also cut at the next multiple of ``snapshot_interval`` (so a step ends at
    every snapshot boundary)."""
    if not chunk_sizes or any(c < 1 for c in chunk_sizes):
        raise ValueError(f"chunk sizes must be >= 1, got {list(chunk_sizes)}")
    if snapshot_interval is not None and snapshot_interval < 1:
        raise ValueError(f"snapshot_interval must be >= 1, got {snapshot_interval}")
    ends: list[int] = []
    pos = begin
    while pos < end:
        stop = min(end, pos + chunk_sizes[min(len(ends), len(chunk_sizes) - 1)])
        if snapshot_interval is not None:
            stop = min(stop, (pos // snapshot_interval + 1) * snapshot_interval)
        ends.append(stop)
        pos = stop
    return ends


def prefill(
    seq: SequenceState,
    tokens: Sequence[kvm.TokenIdExt],
    chunk_sizes: Sequence[int],
    snapshot_interval: int | None = None,
) -> tuple[Array, list[Snapshot]]:
    """Run ``tokens`` (the sequence's next ones) as chunked prefill (see ``chunk_bounds``): the logits of
    every token and, with a ``snapshot_interval``, a snapshot at every multiple of it that a step ends
    at and one after the last token (so a follow-up turn can reuse the whole prompt)."""
    begin = seq.num_tokens
    logits: list[Array] = []
    snapshots: list[Snapshot] = []
    for stop in chunk_bounds(begin, begin + len(tokens), chunk_sizes, snapshot_interval):
        logits.append(seq.step(tokens[seq.num_tokens - begin : stop - begin]))
        if snapshot_interval is not None and (stop % snapshot_interval == 0 or stop == begin + len(tokens)):
            snapshots.append(seq.snapshot())
    if not logits:
        return np.zeros((0, seq.model.cfg.vocab_size)), snapshots
    return np.concatenate(logits), snapshots


def greedy_decode(
    seq: SequenceState, last_logits: Array, num_steps: int, snapshot_interval: int | None = None
) -> tuple[list[kvm.TokenIdExt], Array, list[Snapshot]]:
    """Decode ``num_steps`` tokens greedily, one step each, starting from the logits of the sequence's
    last token: the tokens, the logits of each step ``[num_steps, vocab]`` and, with a
    ``snapshot_interval``, a snapshot whenever the sequence reaches a multiple of it."""
    tokens: list[kvm.TokenIdExt] = []
    logits: list[Array] = []
    snapshots: list[Snapshot] = []
    for _ in range(num_steps):
        token = kvm.TokenId(int(np.argmax(last_logits)))
        tokens.append(token)
        last_logits = seq.step([token])[-1]
        logits.append(last_logits)
        if snapshot_interval is not None and seq.num_tokens % snapshot_interval == 0:
            snapshots.append(seq.snapshot())
    return tokens, np.array(logits).reshape(num_steps, seq.model.cfg.vocab_size), snapshots


def snapshot_error(model: TinyModel, tokens: Sequence[kvm.TokenIdExt], snapshot: Snapshot) -> float:
    """Largest absolute difference between the snapshot's states and the dense reference's states after
    ``tokens[:snapshot.position]`` (the tokens of the sequence the snapshot came from)."""
    if snapshot.position > len(tokens):
        raise ValueError(f"snapshot at {snapshot.position} is past the {len(tokens)} tokens")
    if snapshot.position == 0:
        ref = {i: model.initial_state() for i in snapshot.states}
    else:
        ref = model.dense_states(tokens[: snapshot.position])
    err = 0.0
    for i, s in snapshot.states.items():
        err = max(err, float(np.abs(s.conv_state - ref[i].conv_state).max()))
        err = max(err, float(np.abs(s.ssm_state - ref[i].ssm_state).max()))
    return err
