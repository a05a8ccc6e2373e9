"""Load or recompute (docs/design.md, "Load or recompute"): which prefix of a match a request takes.

A matched block whose pages lie below the GPU is worth loading only when reading its bytes takes
less time than the engine takes to compute its tokens again. For each length a match may end at
(every block boundary, and the match itself with its partial block), the plan estimates the
saving: its tokens at the prefill rate less the read time of the pages that length needs (each
layer group's pages outside its stale range there; a hybrid model's snapshot at its last block),
at their levels' costs (``TierCosts``: bytes at the level's time per byte, plus its latency once
per level, and once per level the wait behind its link's queue, ``TierCosts.wait_s``: the
manager's own queued writes there on top of what ``set_tier_wait`` last said, drained as the clock
runs).
``"auto"`` keeps the length of the largest saving (the longest on a tie), but the whole match when
that cut saves less than one block's recompute time over it (cutting a few tokens of a partial
block saves next to nothing and shifts the request's later steps); ``"never"`` the longest whose
pages are all in GPU memory; a length that lacks a page it needs is no choice. The tree then shortens the cut as it shortens a
match (``ReuseTree.cut``).

A request reading from a level it waits for apart from the engine's steps (disk, remote: read by
background workers while it waits in the loading state; ``TierCosts.apart``) joins the first step
that starts after its reads land, while a recomputed prefix starts computing in the current one:
with the engine's step time known (``KVCacheManager.set_prefill_rate``'s ``step_s``) such a read
costs the current step if it lands within it, else its time and half a step (the boundary after
it, on average: later steps' lengths vary). Reads from the host tier are stream-ordered copies
within the step: they cost their time.

Recomputing takes engine time every request waiting for the engine waits too; loading holds only
this request. With ``waiting`` requests queued for the engine (``KVCacheManager.set_engine_queue``)
a recomputed token costs ``1 + queue_weight * waiting`` times its own time
(``KVCacheManagerConfig.recompute_queue_weight``; 0: only the request's own time). That charge
never makes the request itself slower than recomputing: a length whose reads take longer than
recomputing its tokens (at the rate alone) by more than one engine step (the step it may join
late; 0 while the step time is unknown) is no choice.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._common import LayerGroupId
from .._layers._policy import LayerGroup
from .._reuse._node import Node
from .._reuse._remote_fill import Projection
from .._storage._tier_costs import TierCosts
from .._typed import TypedList
from .._utils import check_int, check_number

#: no remote page is fetched for a local match
NOTHING_FETCHED: frozenset[tuple[int, int]] = frozenset()


class LoadPlanner:
    """The plan of one manager (``load_policy``, the prefill rate, the tiers' costs) and what it did."""

    def __init__(
        self,
        policy: str,
        tokens_per_s: float | None,
        costs: TierCosts,
        layer_groups: TypedList[LayerGroupId, LayerGroup],
        page_bytes: list[int],
        tokens_per_block: int,
        num_levels: int,
        queue_weight: float,
    ) -> None:
        self.policy = policy
        #: the engine's prefill rate, tokens per second (0: unknown)
        self.tokens_per_s = float(tokens_per_s) if tokens_per_s is not None else 0.0
        self.costs = costs
        #: the share of a recomputed token's time charged per request waiting for the engine, and
        #: how many wait now
        self.queue_weight = queue_weight
        self.waiting = 0
        #: an engine step's time, seconds (0: unknown): reads the request waits for apart cost at least a step
        self.step_s = 0.0
        self.policies: list[LayerGroup] = layer_groups.items
        #: bytes of one page of each layer group
        self.page_bytes = page_bytes
        self.tokens_per_block = tokens_per_block
        #: matched tokens by the deepest level of their block's pages: taken (loaded, or in GPU
        #: memory at level 0) and left to recompute by the plan
        self.loaded_tokens = [0] * num_levels
        self.recomputed_tokens = [0] * num_levels
        #: estimated seconds the taken blocks below the GPU saved against recomputing them, and
        #: the cuts saved against loading every matched block
        self.saved_s = 0.0
        self.cut_saved_s = 0.0
        #: matches the plan shortened
        self.cuts = 0

    def set_rate(self, tokens_per_s: object, step_s: object = None) -> None:
        """``KVCacheManager.set_prefill_rate`` past its liveness check (both checked before either is set)."""
        rate = (
            check_number("tokens_per_s", tokens_per_s, True, "tokens per second, or None")
            if tokens_per_s is not None
            else 0.0
        )
        self.step_s = check_number("step_s", step_s, True, "seconds, or None") if step_s is not None else 0.0
        self.tokens_per_s = rate

    def read_cost(self, read: float, apart: bool) -> float:
        """The time a request waits for reads estimated at ``read`` seconds: with ``apart`` (it waits
        for them in the loading state) and a known step time, until the first step that starts
        after they land: the end of the current step if they land within it, else half a step
        after them on average (the later steps' lengths vary)."""
        step = self.step_s
        if not apart or step <= 0.0 or read <= 0.0:
            return read
        return step if read <= step else read + 0.5 * step

    def set_wait(self, level: object, seconds: object) -> None:
        """``KVCacheManager.set_tier_wait`` past its liveness check."""
        lvl = check_int("level", level)
        top = len(self.costs.busy_until) - 1
        if not 1 <= lvl <= top:
            raise ValueError(f"level must be a cache level below the GPU (1 to {top}), got {lvl}")
        self.costs.set_wait(lvl, check_number("seconds", seconds, False, "the link's expected wait"))

    @property
    def active(self) -> bool:
        """Whether the plan may shorten a match ("never"; "auto" with a known prefill rate)."""
        return self.policy == "never" or (self.policy == "auto" and self.tokens_per_s > 0.0)

    def recompute_s(self, tokens: int) -> float:
        """Estimated seconds recomputing ``tokens`` tokens costs (its queue charge included; 0
        without a prefill rate)."""
        rate = self.tokens_per_s
        if rate <= 0.0:
            return 0.0
        return tokens / rate * (1.0 + self.queue_weight * self.waiting)

    def levels(
        self,
        nodes: Sequence[Node | None],
        part: Node | None,
        part_len: int,
        fetched: frozenset[tuple[int, int]] | set[tuple[int, int]],
    ) -> list[list[int]]:
        """Per block of a match (its partial block last) and layer group: the level of its page
        (the remote tier's for a page it fetches), -1 where it has none."""
        n_groups = len(self.policies)
        remote = self.costs.remote_level  # (pages are fetched only where there is a remote tier)
        out: list[list[int]] = []
        num_nodes = len(nodes)
        for ordinal in range(num_nodes + (1 if part_len else 0)):
            node = nodes[ordinal] if ordinal < num_nodes else part
            row = [-1] * n_groups
            for g in range(n_groups):
                if fetched and (ordinal, g) in fetched:
                    row[g] = remote
                elif node is not None:
                    page = node.page(g)
                    if page is not None:
                        row[g] = int(page.level)
            out.append(row)
        return out

    def plan(self, levels: list[list[int]], num_full: int, part_len: int) -> tuple[int, float, float]:
        """The tokens of the match to take (``num_full`` blocks plus ``part_len``: all of it), and the
        estimated savings of that and of the whole match (seconds; 0 without a prefill rate)."""
        t = self.tokens_per_block
        whole = num_full * t + part_len
        rate = self.tokens_per_s
        never = self.policy == "never"
        n_levels = len(self.costs.latency_s)
        n_blocks = len(levels)
        # per layer group, prefix sums over blocks: read seconds, pages missing, pages per level
        sums: list[tuple[list[float], list[int], list[list[int]]]] = []
        for g in range(len(self.policies)):
            cost = [0.0] * (n_blocks + 1)
            missing = [0] * (n_blocks + 1)
            per_level = [[0] * (n_blocks + 1) for _ in range(n_levels)]
            nbytes = self.page_bytes[g]
            per_byte = self.costs.seconds_per_byte
            for o in range(n_blocks):
                lvl = levels[o][g]
                cost[o + 1] = cost[o] + (nbytes * per_byte[lvl] if lvl > 0 else 0.0)
                missing[o + 1] = missing[o] + (1 if lvl < 0 else 0)
                for x in range(n_levels):
                    per_level[x][o + 1] = per_level[x][o] + (1 if x == lvl else 0)
            sums.append((cost, missing, per_level))
        best_len = 0
        best = 0.0
        whole_saving: float | None = None
        whole_own = True
        slack = self.step_s
        candidates = list(range(0, num_full * t + 1, t))
        if part_len:
            candidates.append(whole)
        for length in candidates:
            read = self._read(levels, sums, length, never, n_levels)
            if read is None:
                continue
            saving = self.recompute_s(length) - read if rate > 0.0 else 0.0
            # the request itself never waits longer than recomputing would take it (the queue
            # charge aside), by more than the step it may join late
            own = rate <= 0.0 or length / rate - read >= -slack
            if length == whole:
                whole_saving, whole_own = saving, own
            if never or (own and saving >= best):  # (ascending: the longest on a tie)
                best, best_len = saving, length
        if whole_saving is None:
            return best_len, best, 0.0
        if not never and rate > 0.0 and whole_own and best_len < whole and best - whole_saving < t / rate:
            return whole, whole_saving, whole_saving  # (too small a cut)
        return best_len, best, whole_saving

    def _read(
        self,
        levels: list[list[int]],
        sums: list[tuple[list[float], list[int], list[list[int]]]],
        length: int,
        never: bool,
        n_levels: int,
    ) -> float | None:
        """The estimated time a request taking ``length`` tokens of the match waits for their reads
        (``read_cost``; None: it lacks a page it needs, or under "never" needs one below the GPU)."""
        if length == 0:
            return 0.0
        t = self.tokens_per_block
        nb = (length + t - 1) // t
        read = 0.0
        used = 0  # (a bit per level)
        for g, policy in enumerate(self.policies):
            cost, missing, per_level = sums[g]
            if policy.keeps_live_state:  # the snapshot at the match's last block
                lvl = levels[nb - 1][g]
                if lvl < 0:
                    return None
                if lvl > 0:
                    read += self.page_bytes[g] * self.costs.seconds_per_byte[lvl]
                    used |= 1 << lvl
                continue
            beg, end = policy.stale_range(length)
            r1 = beg if beg < nb else nb
            r2 = max(beg, end)
            if r2 > nb:
                r2 = nb
            if missing[r1] + missing[nb] - missing[r2]:
                return None
            read += cost[r1] + cost[nb] - cost[r2]
            for x in range(1, n_levels):
                counts = per_level[x]
                if counts[r1] + counts[nb] - counts[r2]:
                    used |= 1 << x
        if used and never:
            return None
        return self._waited(read, used)

    def _waited(self, read: float, used: int) -> float:
        """How long a request waits for reads whose bytes take ``read`` seconds from the levels
        set in the bit mask ``used``: each level's latency and queued wait added, then priced by
        ``read_cost``."""
        costs = self.costs
        apart = False
        for x in range(1, len(costs.latency_s)):
            if used >> x & 1:
                read += costs.latency_s[x] + costs.wait_s(x)
                if costs.apart[x]:
                    apart = True
        return self.read_cost(read, apart)

    def in_gpu_memory(self, nodes: list[Node], part: Node | None) -> bool:
        """Whether every page of a local match's blocks is in GPU memory (then the whole match is
        the plan: each block saves its tokens and costs nothing)."""
        n_groups = len(self.policies)
        for node in nodes:
            for g in range(n_groups):
                page = node.page(g)
                if page is not None and page.level > 0:
                    return False
        if part is not None:
            for g in range(n_groups):
                page = part.page(g)
                if page is not None and page.level > 0:
                    return False
        return True

    def count_whole(self, nodes: list[Node], part: Node | None, part_len: int) -> None:
        """Statistics of a create that takes its match whole ("always"; "auto" without a rate): its
        tokens by the deepest level of the pages each block needs, the saving when a rate is known;
        one pass over the match's pages."""
        t = self.tokens_per_block
        length = len(nodes) * t + part_len
        if self.in_gpu_memory(nodes, part):  # (the common case: one quick pass)
            self.loaded_tokens[0] += length
            if self.tokens_per_s > 0.0:
                self.saved_s += self.recompute_s(length)
            return
        n_blocks = len(nodes) + (1 if part_len else 0)
        deepest = [0] * n_blocks
        read = 0.0
        used = 0  # (a bit per level)
        per_byte = self.costs.seconds_per_byte
        for g, policy in enumerate(self.policies):
            beg, end = policy.stale_range(length)
            nbytes = self.page_bytes[g]
            for o in range(n_blocks):
                if beg <= o < end and not (policy.keeps_live_state and o == n_blocks - 1):
                    continue
                node = nodes[o] if o < len(nodes) else part
                page = node.page(g) if node is not None else None
                if page is None:
                    continue
                lvl = int(page.level)
                if lvl > 0:
                    read += nbytes * per_byte[lvl]
                    used |= 1 << lvl
                    if lvl > deepest[o]:
                        deepest[o] = lvl
        for o in range(n_blocks):
            end_o = (o + 1) * t if (o + 1) * t < length else length
            self.loaded_tokens[deepest[o]] += end_o - o * t
        if self.tokens_per_s > 0.0 and length:
            self.saved_s += self.recompute_s(length) - self._waited(read, used)

    def count_taken_whole(self, projection: Projection) -> None:
        """Statistics of a create that takes whole a match the remote tier extends (``projection``,
        before the fetch): its fetched blocks counted as the remote tier's."""
        nodes, part, part_len, fetched = projection
        levels = self.levels(nodes, part, part_len, fetched)
        length = len(nodes) * self.tokens_per_block + part_len
        whole_saving = self.plan(levels, len(nodes), part_len)[2] if self.tokens_per_s > 0.0 else 0.0
        self.count(levels, length, length, whole_saving, whole_saving)

    def count(self, levels: list[list[int]], length: int, taken: int, saved: float, whole_saving: float) -> None:
        """Statistics of a create: ``taken`` tokens of the ``length``-token match ``levels`` describes."""
        t = self.tokens_per_block
        for o, row in enumerate(levels):
            deepest = 0
            for lvl in row:
                if lvl > deepest:
                    deepest = lvl
            end = (o + 1) * t if (o + 1) * t < length else length
            if o * t < taken:
                self.loaded_tokens[deepest] += (end if end < taken else taken) - o * t
            if end > taken:
                self.recomputed_tokens[deepest] += end - (o * t if o * t > taken else taken)
        self.saved_s += saved
        self.cut_saved_s += saved - whole_saving
