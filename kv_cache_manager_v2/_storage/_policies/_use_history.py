"""Use counting for the frequency eviction policy: :class:`UseHistory` counts block uses by key,
survives eviction in a set-associative ghost table, and learns the adaptive aging from an LRU
cache of the same size simulated beside the policy (see ``_frequency.py``)."""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Final, cast, final

from ..._common import RequestSerial
from ..._page import NO_SERIAL, Page, PolicyState

#: Frequency policy: ghost entries per slot of the last level, and entries per set (the study:
#: 16 ways evict the fewest-uses entry of a wide neighbourhood, which beats 4 ways by 0.003 at 1M).
GHOST_PER_SLOT: Final = 8
GHOST_WAYS: Final = 16
#: a ghost entry's rank: min(uses, _MAX_RANKED_USES) above 40 bits of stamp (lowest replaced first)
_STAMP_BITS: Final = 40
_MAX_RANKED_USES: Final = (1 << 22) - 1
#: Frequency policy, adaptive aging (issue #31): ``UseHistory.aging`` starts at AGING_START and
#: moves by the factor ``1 + AGING_STEP`` per page on which the policy and the simulated LRU
#: disagree, within [AGING_MIN, AGING_MAX] (at the top, a page's rate buys it a small fraction
#: of a cache turnover: recency order). Up to AGING_ON it adds nothing to the clock (pure
#: use-rate order): where frequency wins, the two kinds of disagreement still come in runs that
#: move the aging by a decade or two (the floor, two decades below, absorbs them), and even
#: aging 1e-4 / slots**2 per victim costs hit rate (the smallest rates are ~1e-8). The study
#: (benchmarks/eviction_study.py, ``shadow_aging`` and its variants) chose these: step 0.002,
#: a floor of 1e-3 or a start at AGING_ON drift to recency on the documents trace at 3M tokens;
#: step 0.001 or a start at the floor adapt too late on long chats.
AGING_STEP: Final = 0.0015
AGING_MIN: Final = 1e-4
AGING_START: Final = 1e-3
AGING_ON: Final = 0.01
AGING_MAX: Final = 1e4
#: a ghost tag: the first 8 bytes of the block key (its first 4 choose the set)
_TAG_BYTES: Final = 8
_EMPTY_TAG: Final = bytes(_TAG_BYTES)
_ZERO_TAG_STAND_IN: Final = b"\x01" + bytes(_TAG_BYTES - 1)


#: ``FrequencyState.pos`` of a page in no heap (``_frequency.py`` has the other values)
NOT_IN_HEAP: Final = -1


@final
class FrequencyState(PolicyState):
    """A page's state under the frequency policy: requests that used its block (history
    included), the use clock at the first, the last one counted; the value, sequence number and
    heap position it was listed with (``_frequency.py``)."""

    __slots__ = ("first_use", "key", "pos", "seq", "use_serial", "uses")

    def __init__(self) -> None:
        self.uses = 0
        self.first_use = 0
        self.use_serial = NO_SERIAL
        self.key = 0.0
        self.seq = 0
        self.pos = NOT_IN_HEAP


def frequency_state(page: Page) -> FrequencyState:
    """``page``'s state under the frequency policy (made when first needed)."""
    st = page.policy_state
    if st is None:
        fresh = FrequencyState()
        page.policy_state = fresh
        return fresh
    return cast(FrequencyState, st)


def state_of(page: Page) -> FrequencyState:
    """The state of a page the frequency policy already counted or listed."""
    return cast(FrequencyState, page.policy_state)


def ghost_tag(key: bytes) -> bytes:
    """The ghost tag of a block key: its first 8 bytes (never the empty marker)."""
    tag = key[:_TAG_BYTES]
    return tag if tag != _EMPTY_TAG else _ZERO_TAG_STAND_IN


class UseHistory:
    """Use counting of one pool group for the frequency policy, shared by its evictors of every
    cache level: the use clock, and the ghost table that remembers the blocks that left.

    A *use* is a request taking a reusable page (a match, a partial-match source, a dedup at
    publish) or publishing its own page into the tree; a request counts once per page
    (``FrequencyState.use_serial``). ``now`` counts uses. A page counted for the first time resumes what
    the ghost remembers of its block (``uses``, ``first_use``); a page dropped for good while in
    the tree is remembered there.

    The ghost is a set-associative table of ``GHOST_PER_SLOT`` x the last level's slots entries,
    ``GHOST_WAYS`` per set, keyed by the first 8 bytes of the block key (a SHA-256 digest; 4 of
    them pick the set); a full set replaces its entry with the fewest uses, then the oldest.
    Contiguous storage (24 bytes an entry): tags in a ``bytearray`` searched in C, ranks (uses
    and stamp) and first uses in ``array('q')``; a set fits in a few cache lines.

    Adaptive aging (``aging``, read by the evictors at each victim): ``recent`` simulates what
    ``eviction_policy="lru"`` would hold: the keys of the last ``lru_slots`` (the pool group's
    slots, every level) blocks whose pages became DROPPABLE, in that order (LRU's eviction
    order; its levels together act as one LRU list), without the data. A page a request takes
    that this LRU would not have (kept, where LRU would have lost it) lowers ``aging`` by one
    step; a page a request publishes (a miss) that this LRU still has raises it. O(1) per use
    and release. It ignores the slots that requests hold: where they hold much of the cache it
    overrates LRU a little (the aging leans to recency, LRU's side). Trimming it to the
    DROPPABLE count at each victim was tried: the check of a request's misses then comes after
    its own evictions, which had already trimmed blocks LRU would have matched (0.003 lower on
    long chats at 3M through the manager).
    """

    __slots__ = ("_firsts", "_num_sets", "_ranks", "_stamp", "_tags", "aging", "lru_slots", "now", "recent")

    def __init__(self, num_slots: int) -> None:
        #: block uses so far in this pool group (the clock of first uses and rates)
        self.now = 0
        #: clock rise per victim, in units of 1 / slots**2 of the evicting level (adapts)
        self.aging = AGING_START
        #: the simulated LRU: keys of the blocks it holds, oldest first, at most ``lru_slots``
        self.recent: OrderedDict[bytes, None] = OrderedDict()
        #: slots of the pool group's levels together (each frequency evictor adds its own)
        self.lru_slots = 0
        self._stamp = 0
        self._num_sets = 1
        self._tags = bytearray()
        self._ranks: array[int] = array("q")
        self._firsts: array[int] = array("q")
        self.resize(num_slots)

    def resize(self, num_slots: int) -> None:
        """Size the ghost for a last level of ``num_slots`` slots (keeps what fits, newest first)."""
        tags, ranks, firsts = self._tags, self._ranks, self._firsts
        old = sorted(
            (ranks[i] & ((1 << _STAMP_BITS) - 1), i)
            for i in range(len(ranks))
            if tags[i * _TAG_BYTES : (i + 1) * _TAG_BYTES] != _EMPTY_TAG
        )
        self._num_sets = max(1, GHOST_PER_SLOT * num_slots // GHOST_WAYS)
        n = self._num_sets * GHOST_WAYS
        self._tags = bytearray(n * _TAG_BYTES)
        self._ranks = array("q", [0]) * n
        self._firsts = array("q", [0]) * n
        for _, i in old:  # oldest first: the newest win where a set overflows
            tag = bytes(tags[i * _TAG_BYTES : (i + 1) * _TAG_BYTES])
            self._put(tag, ranks[i] >> _STAMP_BITS, firsts[i])

    @property
    def num_entries(self) -> int:
        return len(self._ranks)

    def use(self, page: Page, serial: RequestSerial, cached: bool) -> None:
        """Request ``serial`` uses ``page`` (a page in the tree; ``cached``: a hit, else the
        request publishes it); counted once per request. Where the simulated LRU disagrees (a
        hit it would have missed, a miss it would have hit), the aging moves one step."""
        st = frequency_state(page)
        if st.use_serial == serial:
            return
        st.use_serial = serial
        self.now += 1
        node = page.node
        assert node is not None
        key = node.key
        if cached != (key in self.recent):
            if cached:  # kept where LRU would have lost it: less recency
                self.aging = max(AGING_MIN, self.aging / (1.0 + AGING_STEP))
            else:  # lost where LRU would still have it: more recency
                self.aging = min(AGING_MAX, self.aging * (1.0 + AGING_STEP))
        if st.uses == 0:  # never counted: resume the block's history, if remembered
            i = self._find(ghost_tag(key))
            if i < 0:
                st.first_use = self.now
            else:
                self._tags[i * _TAG_BYTES : (i + 1) * _TAG_BYTES] = _EMPTY_TAG  # the page carries it now
                st.uses = self._ranks[i] >> _STAMP_BITS
                st.first_use = self._firsts[i]
        st.uses += 1

    def released(self, page: Page) -> None:
        """``page`` (in the tree) became DROPPABLE: the simulated LRU lists its block as the newest
        (and forgets its oldest beyond ``lru_slots``)."""
        node = page.node
        assert node is not None
        key = node.key  # the key object itself: its hash is computed once
        recent = self.recent
        if key in recent:
            recent.move_to_end(key)
            return
        recent[key] = None
        while len(recent) > self.lru_slots:
            recent.popitem(last=False)

    def record(self, page: Page) -> None:
        """``page`` (in the tree) is dropped for good: remember its block's uses."""
        node = page.node
        st = page.policy_state
        if node is not None and st is not None:
            fs = cast(FrequencyState, st)
            if fs.uses:
                self._put(ghost_tag(node.key), fs.uses, fs.first_use)

    def remembers(self, key: bytes) -> int:
        """Uses the ghost remembers of the block with ``key`` (0: none; for tests)."""
        i = self._find(ghost_tag(key))
        return self._ranks[i] >> _STAMP_BITS if i >= 0 else 0

    def _set(self, tag: bytes) -> int:
        """The set of a tag: its first 4 bytes modulo the number of sets."""
        return (tag[0] | tag[1] << 8 | tag[2] << 16 | tag[3] << 24) % self._num_sets

    def _find(self, tag: bytes, s: int = -1) -> int:
        """The entry holding ``tag`` in its set (or in set ``s``), or -1."""
        tags = self._tags
        lo = (self._set(tag) if s < 0 else s) * GHOST_WAYS * _TAG_BYTES
        hi = lo + GHOST_WAYS * _TAG_BYTES
        pos = tags.find(tag, lo, hi)
        while pos >= 0 and pos % _TAG_BYTES:  # a match across two entries: look further
            pos = tags.find(tag, pos + 1, hi)
        return pos // _TAG_BYTES if pos >= 0 else -1

    def _put(self, tag: bytes, uses: int, first: int) -> None:
        self._stamp += 1
        s = self._set(tag)
        i = self._find(_EMPTY_TAG, s)
        if i < 0:  # the set is full: replace its lowest rank (fewest uses, then the oldest)
            base = s * GHOST_WAYS
            ranks = self._ranks[base : base + GHOST_WAYS]
            i = base + ranks.index(min(ranks))
        self._tags[i * _TAG_BYTES : (i + 1) * _TAG_BYTES] = tag
        self._ranks[i] = min(uses, _MAX_RANKED_USES) << _STAMP_BITS | self._stamp
        self._firsts[i] = first
