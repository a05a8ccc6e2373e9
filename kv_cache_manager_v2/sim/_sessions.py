"""A workload's conversations and sessions, from its prompts alone: request ``i`` *continues*
when a later request's prompt starts with ``i``'s whole prompt (``continuers``; their chains are
conversations), prefixes many conversations share are templates or system prompts
(``shared_prefixes``, ``system_prompts``), and a trace's sessions are its documents: requests whose
prompts share whole blocks beyond their template (``document_sessions``), the same document (an
agent's task) queried again with another question. ``sim/_hints.py`` turns them into the hints
and directives of an engine that knows them.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._workload import TRACE_BLOCK_TOKENS, SimRequest

#: a trace's session (``document_sessions``): prompts sharing this many whole blocks beyond their
#: template, a prefix more than TEMPLATE_CONVERSATIONS conversations start with
DOCUMENT_BLOCKS = 1
TEMPLATE_CONVERSATIONS = 8


def arrival_order(requests: Sequence[SimRequest]) -> list[int]:
    """The requests' indices in the order they arrive (ties: by index)."""
    return sorted(range(len(requests)), key=lambda k: (requests[k].arrival_ms, k))


def continuation_pauses(requests: Sequence[SimRequest], granularity: int = 1) -> list[float | None]:
    """Per request, seconds until the first later request whose prompt starts with its prompt
    (its conversation continues), or None. ``granularity``: prompts are compared up to their last
    multiple of this many tokens (a trace's 512-token blocks: a trace names a prompt's partial
    last block apart from the full block a later turn holds there; shorter prompts never continue)."""
    return [
        (requests[j].arrival_ms - requests[i].arrival_ms) / 1000.0 if j is not None else None
        for i, j in enumerate(continuers(requests, granularity))
    ]


def continuers(requests: Sequence[SimRequest], granularity: int = 1) -> list[int | None]:
    """Per request, the index of the first later request whose prompt starts with its prompt
    (see ``continuation_pauses``), or None."""
    order = arrival_order(requests)
    chain_ids: dict[tuple[int, int, int], int] = {}  # (parent chain, first, count) -> chain id
    # requests waiting for a continuation, by (chain of all but their last run, last run's first
    # token): (last run's length, request)
    waiting: dict[tuple[int, int], list[tuple[int, int]]] = {}
    out: list[int | None] = [None] * len(requests)
    for j in order:
        req = requests[j]
        segs = _truncated(req.prompt_segments, req.prompt_length // granularity * granularity)
        parent = -1
        for first, count in segs:  # every waiting prompt this one extends
            group = waiting.get((parent, first))
            if group is not None:
                kept = [(n, i) for n, i in group if n > count]
                for n, i in group:
                    if n <= count:
                        out[i] = j
                if kept:
                    waiting[(parent, first)] = kept
                else:
                    del waiting[(parent, first)]
            key = (parent, first, count)
            parent = chain_ids.setdefault(key, len(chain_ids))
        if segs:
            prefix = -1
            for first, count in segs[:-1]:
                prefix = chain_ids[(prefix, first, count)]
            waiting.setdefault((prefix, segs[-1][0]), []).append((segs[-1][1], j))
    return out


def conversations(next_turn: Sequence[int | None]) -> list[int]:
    """Per request, its conversation (the index of the conversation's last request), following
    ``continuers``' links."""
    out = [-1] * len(next_turn)
    for i in range(len(next_turn)):
        path = []
        k = i
        while out[k] < 0:
            path.append(k)
            nxt = next_turn[k]
            if nxt is None:
                out[k] = k
                break
            k = nxt
        for p in path:
            out[p] = out[k]
    return out


def _truncated(segments: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """The token runs of the first ``length`` tokens of ``segments``."""
    out: list[tuple[int, int]] = []
    for first, count in segments:
        if length <= 0:
            break
        out.append((first, min(count, length)))
        length -= count
    return out


def shared_prefixes(
    requests: Sequence[SimRequest], more_than: int, granularity: int, conversation: Sequence[int] | None = None
) -> list[tuple[int, int] | None]:
    """Per request, the longest prefix of its prompt that more than ``more_than`` requests of the
    workload start with (``conversation``, per request: more than that many distinct
    conversations), as (prefix id, tokens), or None; prompts are compared in whole runs of
    ``granularity`` tokens (a block)."""
    paths, users = prefix_users(requests, granularity, conversation)
    out: list[tuple[int, int] | None] = []
    for path in paths:
        depth = 0
        while depth < len(path) and users[path[depth]] > more_than:
            depth += 1
        out.append((path[depth - 1], depth * granularity) if depth else None)
    return out


def prefix_users(
    requests: Sequence[SimRequest], granularity: int, conversation: Sequence[int] | None
) -> tuple[list[list[int]], list[int]]:
    """Each request's prompt as a path of prefix ids (one per whole block), and per prefix id the
    number of requests (or distinct ``conversation`` ids) that start with it."""
    ids: dict[tuple[int, tuple[tuple[int, int], ...]], int] = {}  # (parent prefix, next chunk) -> prefix id
    users: list[set[int]] = []
    paths: list[list[int]] = []
    for i, r in enumerate(requests):
        who = conversation[i] if conversation is not None else i
        path: list[int] = []
        prefix = -1
        for chunk in _chunks(r.prompt_segments, r.prompt_length // granularity, granularity):
            prefix = ids.setdefault((prefix, chunk), len(ids))
            if prefix == len(users):
                users.append(set())
            users[prefix].add(who)
            path.append(prefix)
        paths.append(path)
    return paths, [len(u) for u in users]


def _chunks(segments: list[tuple[int, int]], num: int, size: int) -> list[tuple[tuple[int, int], ...]]:
    """The first ``num`` chunks of ``size`` tokens of ``segments``, each as its token runs (merged)."""
    out: list[tuple[tuple[int, int], ...]] = []
    cur: list[tuple[int, int]] = []
    room = size
    for first, count in segments:
        while count and len(out) < num:
            n = min(count, room)
            if cur and cur[-1][0] + cur[-1][1] == first:  # adjacent runs: one (the same tokens compare equal)
                cur[-1] = (cur[-1][0], cur[-1][1] + n)
            else:
                cur.append((first, n))
            first += n
            count -= n
            room -= n
            if not room:
                out.append(tuple(cur))
                cur = []
                room = size
    return out


def system_prompts(requests: Sequence[SimRequest], more_than: int, granularity: int) -> list[tuple[int, int] | None]:
    """``shared_prefixes`` of distinct conversations (chains of ``continuers``): what an engine
    knows as a system prompt or template, shared by more than ``more_than`` conversations."""
    talks = conversations(continuers(requests, trace_granularity(requests)))
    return shared_prefixes(requests, more_than, granularity, talks)


def trace_granularity(requests: Sequence[SimRequest]) -> int:
    """Prompts of a trace are compared in its 512-token blocks (see ``continuation_pauses``)."""
    return TRACE_BLOCK_TOKENS if requests and requests[0].source_line else 1


def session_ids(requests: Sequence[SimRequest]) -> tuple[list[str], set[int]]:
    """``--sessions``: per request, its session id (the built-in workload's conversations, the
    chains of ``continuers``; a trace's ``document_sessions``), and the requests that end a
    session (its last request: ``--session-end``)."""
    sessions = sessions_of(requests)
    last: dict[int, int] = {}
    for k in arrival_order(requests):
        last[sessions[k]] = k
    return [f"session-{s}" for s in sessions], set(last.values())


def sessions_of(requests: Sequence[SimRequest]) -> list[int]:
    """Per request, its session's index (see ``session_ids``)."""
    if requests and requests[0].source_line:
        return document_sessions(requests, TRACE_BLOCK_TOKENS)
    return conversations(continuers(requests))


def document_sessions(
    requests: Sequence[SimRequest],
    granularity: int,
    min_blocks: int = DOCUMENT_BLOCKS,
    template_conversations: int = TEMPLATE_CONVERSATIONS,
) -> list[int]:
    """Per request, its session (the index of its first request) derived from shared chains of
    blocks (a trace's ``hash_ids``): requests whose prompts share at least ``min_blocks`` whole
    blocks of ``granularity`` tokens beyond their template (the prefix more than
    ``template_conversations`` conversations start with) are one session: a document (an agent's
    task) queried again, and with it the conversations (``continuers``) of its requests."""
    talks = conversations(continuers(requests, granularity))
    paths, users = prefix_users(requests, granularity, talks)
    root = list(range(len(requests)))

    def find(k: int) -> int:
        while root[k] != k:
            root[k] = root[root[k]]
            k = root[k]
        return k

    def join(a: int, b: int) -> None:
        a, b = find(a), find(b)
        root[max(a, b)] = min(a, b)

    first_user: dict[int, int] = {}  # prefix id -> the first request whose document it is
    for i, path in enumerate(paths):
        join(i, talks[i])
        depth = 0
        while depth < len(path) and users[path[depth]] > template_conversations:
            depth += 1
        depth += min_blocks - 1  # the prefix ending at the document's first blocks
        if depth < len(path):
            join(i, first_user.setdefault(path[depth], i))
    return [find(i) for i in range(len(requests))]


def session_pauses(requests: Sequence[SimRequest], sessions: Sequence[int]) -> list[float | None]:
    """Per request, seconds until the next request of its session, or None (its last)."""
    out: list[float | None] = [None] * len(requests)
    prev: dict[int, int] = {}
    for k in arrival_order(requests):
        i = prev.get(sessions[k])
        if i is not None:
            out[i] = (requests[k].arrival_ms - requests[i].arrival_ms) / 1000.0
        prev[sessions[k]] = k
    return out


def session_templates(requests: Sequence[SimRequest], sessions: Sequence[int], granularity: int) -> list[int]:
    """Per request, the tokens of the prefix of its prompt other sessions start with (in whole
    blocks of ``granularity`` tokens): its system prompt or template, which an engine knows."""
    return [p[1] if p is not None else 0 for p in shared_prefixes(requests, 1, granularity, sessions)]


def session_prefixes(requests: Sequence[SimRequest], sessions: Sequence[int], granularity: int) -> list[int | None]:
    """Per request, the tokens of the longest prefix of its prompt another request of its session
    shares, in whole blocks of ``granularity`` tokens (its document), or None where that is all
    of them or none (the session's requests extend it whole, or it is alone in its session)."""
    paths, _ = prefix_users(requests, granularity, None)
    count: dict[tuple[int, int], int] = {}  # (prefix id, session) -> requests
    for i, path in enumerate(paths):
        for prefix in path:
            key = (prefix, sessions[i])
            count[key] = count.get(key, 0) + 1
    out: list[int | None] = []
    for i, path in enumerate(paths):
        depth = 0
        while depth < len(path) and count[(path[depth], sessions[i])] > 1:
            depth += 1
        out.append(depth * granularity if 0 < depth < len(path) else None)
    return out
