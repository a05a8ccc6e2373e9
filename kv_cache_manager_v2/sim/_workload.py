"""Workloads: a Mooncake-format trace, or built-in multi-turn conversations with shared system prompts.

A request's tokens are described by *segments* (runs of consecutive token ids), materialized
only when the request arrives. Trace block ``h`` is tokens ``h * 512 .. h * 512 + 511`` (so equal
ids give equal tokens); generated tokens come from a range no prompt uses, unique per request,
except where a conversation's next turn repeats them.
"""

from __future__ import annotations

import json
import math
import random
from array import array
from dataclasses import dataclass

import numpy as np

from .._common import SessionId
from ._models import SimUserError

#: tokens per ``hash_ids`` block of a Mooncake trace
TRACE_BLOCK_TOKENS = 512
#: output tokens are drawn from [OUTPUT_BASE, 2**32): no trace or generated prompt token is there
OUTPUT_BASE = 1 << 31
#: longest output of a trace request (each gets this many token ids of its own)
MAX_OUTPUT = 65_536
#: longest prompt a request may have (a trace line's input_length): 16M tokens
MAX_PROMPT_TOKENS = 1 << 24
#: longest trace line read (a 16M-token prompt's hash_ids fit in far less): anything longer is not a trace
MAX_LINE_BYTES = 4 << 20
#: the built-in workload's limits: its requests and prompt segments are all in memory at once
MAX_CONVERSATIONS = 100_000
MAX_TURNS = 1_000
MAX_SYSTEM_PROMPTS = 10_000
MAX_SEGMENTS = 5_000_000
#: the latest arrival a replay takes (a trace's timestamp, times --time-scale): a year, in ms;
#: later ones are a wrong unit or a broken trace, and the report's times would mean nothing
MAX_ARRIVAL_MS = 365 * 24 * 3600 * 1000


@dataclass
class SimRequest:
    """One request of the workload."""

    index: int  #: position in the workload (request id)
    arrival_ms: float
    prompt_segments: list[tuple[int, int]]  #: (first token id, count) runs
    prompt_length: int
    output_length: int
    output_base: int  #: generated token i is ``output_base + i``
    after: int = -1  #: index of the request that must finish first (the previous turn), -1: none
    source_line: int = 0  #: trace line (1-based), 0 for generated requests
    #: the first ``reasoning`` output tokens are reasoning: no later request reuses them (``--reasoning-share``)
    reasoning: int = 0
    #: its conversation's session id (``--sessions``); its close ends the session (``--session-end``),
    #: keeping the first ``session_keep`` tokens of its prompt (the system prompt other conversations share)
    session: SessionId | None = None
    ends_session: bool = False
    session_keep: int = 0

    def prompt_tokens(self) -> array[int]:
        """The prompt as ``array('I')`` (cheapest for the manager to hash)."""
        out = array("I")
        parts = [np.arange(first, first + count, dtype=np.uint32) for first, count in self.prompt_segments]
        out.frombytes(np.concatenate(parts).tobytes())
        return out


def segments_of_blocks(ids: list[int], length: int) -> list[tuple[int, int]]:
    """Token runs of trace blocks ``ids`` truncated to ``length`` tokens (adjacent blocks merged)."""
    segs: list[tuple[int, int]] = []
    left = length
    b = TRACE_BLOCK_TOKENS
    for h in ids:
        if left <= 0:
            break
        n = b if left >= b else left
        first = h * b
        if segs and segs[-1][0] + segs[-1][1] == first:
            segs[-1] = (segs[-1][0], segs[-1][1] + n)
        else:
            segs.append((first, n))
        left -= n
    return segs


def _field_int(rec: dict[str, object], key: str, where: str, minimum: int) -> int:
    if key not in rec:
        raise SimUserError(
            f"{where}: missing field {key!r} (a Mooncake line has timestamp, input_length, output_length, hash_ids)"
        )
    v = rec[key]
    if type(v) is not int or v < minimum:
        raise SimUserError(f"{where}: {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def _parse_line(line: str, where: str, line_no: int, idx: int) -> SimRequest:
    """One Mooncake JSON line as request ``idx``; SimUserError naming ``where`` if malformed."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise SimUserError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rec, dict):
        raise SimUserError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    ts = rec.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 <= ts <= MAX_ARRIVAL_MS:
        raise SimUserError(
            f"{where}: 'timestamp' must be a number in [0, {MAX_ARRIVAL_MS:,}] (milliseconds from the trace's "
            f"start: up to a year), got {ts!r}"
        )
    n_in = _field_int(rec, "input_length", where, 1)
    if n_in > MAX_PROMPT_TOKENS:
        raise SimUserError(f"{where}: input_length {n_in} is above {MAX_PROMPT_TOKENS}")
    n_out = _field_int(rec, "output_length", where, 0)
    if n_out > MAX_OUTPUT:
        raise SimUserError(f"{where}: output_length {n_out} is above {MAX_OUTPUT}")
    ids = rec.get("hash_ids")
    max_id = OUTPUT_BASE // TRACE_BLOCK_TOKENS - 1
    if not isinstance(ids, list) or not all(type(h) is int and 0 <= h <= max_id for h in ids):
        raise SimUserError(f"{where}: 'hash_ids' must be a list of integers in [0, {max_id}]")
    need = (n_in + TRACE_BLOCK_TOKENS - 1) // TRACE_BLOCK_TOKENS
    if len(ids) != need:
        raise SimUserError(
            f"{where}: input_length {n_in} needs {need} hash_ids ({TRACE_BLOCK_TOKENS} tokens each), got {len(ids)}"
        )
    # generated tokens: MAX_OUTPUT ids of their own per request
    base = OUTPUT_BASE + idx * MAX_OUTPUT % (OUTPUT_BASE - MAX_OUTPUT)
    return SimRequest(idx, float(ts), segments_of_blocks(ids, n_in), n_in, max(n_out, 1), base, source_line=line_no)


def load_trace(path: str, limit: int = 0, reasoning_share: float = 0.0) -> list[SimRequest]:
    """Read a Mooncake-format trace (JSON lines); ``limit`` > 0 keeps the first requests only;
    ``reasoning_share``: ``mark_reasoning``.

    Raises :class:`SimUserError` naming the line for anything malformed.
    """
    out: list[SimRequest] = []
    line_no = 0
    try:
        with open(path, "rb") as f:
            while raw := f.readline(MAX_LINE_BYTES + 1):  # bounded: /dev/zero has no line end
                line_no += 1
                if len(raw) > MAX_LINE_BYTES:
                    raise SimUserError(
                        f"{path} line {line_no}: longer than {MAX_LINE_BYTES >> 20} MiB; is this a JSON-lines trace?"
                    )
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise SimUserError(f"{path} line {line_no}: not UTF-8 text; is this a JSON-lines trace?") from None
                if not line.strip():
                    continue
                out.append(_parse_line(line, f"{path} line {line_no}", line_no, len(out)))
                if limit and len(out) >= limit:
                    break
    except OSError as e:
        raise SimUserError(f"--trace {path}: cannot read it ({e.strerror or e})") from None
    if not out:
        raise SimUserError(f"--trace {path}: no requests in it")
    if reasoning_share:
        mark_reasoning(out, reasoning_share)
    return out


@dataclass(frozen=True)
class ConversationParams:
    """The built-in workload: conversations arrive at ``rate`` per second; each picks one of
    ``system_prompts`` shared prompts and runs about ``turns`` turns; turn k's prompt is the whole
    conversation so far (system prompt, earlier questions and answers) plus a new question."""

    conversations: int = 200
    turns: float = 4.0
    system_prompts: int = 4
    system_tokens: int = 2048
    user_tokens: int = 384
    output_tokens: int = 192
    rate: float = 2.0  #: new conversations per second
    think_s: float = 5.0  #: mean pause between an answer and the next question
    seed: int = 0

    def validate(self) -> None:
        for name, n, lo, hi in (
            ("--conversations", self.conversations, 1, MAX_CONVERSATIONS),
            ("--system-prompts", self.system_prompts, 1, MAX_SYSTEM_PROMPTS),
            ("--system-tokens", self.system_tokens, 0, MAX_PROMPT_TOKENS),
            ("--user-tokens", self.user_tokens, 1, MAX_PROMPT_TOKENS),
            ("--output-tokens", self.output_tokens, 1, MAX_OUTPUT),
        ):
            if not lo <= n <= hi:
                raise SimUserError(f"{name} must be in [{lo}, {hi:,}], got {n}")
        if not 1.0 <= self.turns <= MAX_TURNS:  # (NaN fails every comparison)
            raise SimUserError(f"--turns must be in [1, {MAX_TURNS:,}], got {self.turns}")
        if not 0.0 <= self.think_s < math.inf:
            raise SimUserError(f"--think-s must be a finite number >= 0, got {self.think_s}")
        if not 0.0 < self.rate < math.inf:
            raise SimUserError(f"--rate must be a finite number > 0 (conversations per second), got {self.rate}")


def check_reasoning_share(share: float) -> None:
    """``--reasoning-share``: a share of output tokens in [0, 1)."""
    if not 0.0 <= share < 1.0:
        raise SimUserError(f"--reasoning-share must be in [0, 1) (a share of each answer's tokens), got {share:g}")


def mark_reasoning(requests: list[SimRequest], share: float) -> None:
    """A trace's requests: the first ``share`` of each output is reasoning (a trace's later prompts
    say by themselves what they reuse)."""
    check_reasoning_share(share)
    for r in requests:
        r.reasoning = int(share * r.output_length)


def _around(rng: random.Random, mean: int) -> int:
    """A length uniform in [mean/2, 3*mean/2] (at least 1)."""
    return max(1, int(rng.uniform(0.5, 1.5) * mean))


def generate_conversations(p: ConversationParams, limit: int = 0, reasoning_share: float = 0.0) -> list[SimRequest]:
    """The built-in workload (deterministic for a seed); ``limit`` > 0 keeps the first requests by
    arrival. ``reasoning_share``: that share of each answer's tokens (its start) is reasoning, which
    the next turn's prompt leaves out (as chat templates of reasoning models do)."""
    p.validate()
    check_reasoning_share(reasoning_share)
    rng = random.Random(p.seed)
    next_token = 1  # fresh token ids for prompts: below OUTPUT_BASE
    systems: list[tuple[int, int]] = []
    for _ in range(p.system_prompts):
        n = _around(rng, p.system_tokens) if p.system_tokens else 0
        systems.append((next_token, n))
        next_token += n
    weights = [1.0 / (k + 1) for k in range(p.system_prompts)]  # a few popular system prompts
    out: list[SimRequest] = []
    t_ms = 0.0
    out_cursor = OUTPUT_BASE
    segments = 0
    for _ in range(p.conversations):
        t_ms += rng.expovariate(p.rate) * 1000.0
        turns = 1 + int(rng.expovariate(1.0 / max(p.turns - 1.0, 1e-9))) if p.turns > 1 else 1
        sys_first, sys_len = systems[rng.choices(range(p.system_prompts), weights)[0]]
        history: list[tuple[int, int]] = [(sys_first, sys_len)] if sys_len else []
        length = sys_len
        arrival = t_ms
        prev = -1
        for _turn in range(turns):
            q = _around(rng, p.user_tokens)
            segs = history + [(next_token, q)]
            next_token += q
            n_out = _around(rng, p.output_tokens)
            if out_cursor + n_out >= 1 << 32 or next_token >= OUTPUT_BASE:
                raise SimUserError("the built-in workload is too large for 32-bit token ids; lower --conversations")
            segments += len(segs)
            if segments > MAX_SEGMENTS or length + q > MAX_PROMPT_TOKENS:
                raise SimUserError(
                    "the built-in workload is too large to hold in memory (its conversations grow with every turn); "
                    "lower --conversations, --turns or the token counts"
                )
            thought = int(reasoning_share * n_out)
            req = SimRequest(len(out), arrival, segs, length + q, n_out, out_cursor, after=prev, reasoning=thought)
            out.append(req)
            # the next turn repeats the question and the answer (without its reasoning)
            history = segs + [(out_cursor + thought, n_out - thought)]
            length += q + n_out - thought
            out_cursor += n_out
            prev = req.index
            # the next question comes after a pause; the scheduler also waits for this answer
            arrival += rng.expovariate(1.0 / p.think_s) * 1000.0 if p.think_s > 0 else 0.0
    out.sort(key=lambda r: (r.arrival_ms, r.index))
    remap = {r.index: i for i, r in enumerate(out)}
    for i, r in enumerate(out):
        r.index = i
        r.after = remap[r.after] if r.after >= 0 else -1
    if limit:
        out = [r for r in out[:limit] if r.after < limit]
    return out
