"""The remote store's write side: a ring of ``max_pending_bytes`` the scheduler's thread copies pages
into (or slots of dropped pages handed off without a copy), and a background thread that sends them
in batches (one backend call each). Enqueueing never blocks: what does not fit, or meets a server that is down,
is dropped and counted."""

from __future__ import annotations

import mmap
import threading
import time
from collections import deque
from typing import Any, Final

from ..._common import SlotId
from ..._config import RemoteCacheTierConfig
from .._tiers._base import DetachedSlot
from ._backend import LOG
from ._client import RemoteClient
from ._value import HEADER_BYTES, Carried, encode_header, forget_frames

#: a write batch ends at this many pages or bytes
BATCH_PAGES: Final = 256
BATCH_BYTES: Final = 8 << 20
#: the writer looks at its queue this often while there is work (a burst of drops goes out as one
#: batch), backing off to ``IDLE_POLL_S`` when there is none. Enqueueing never wakes it: waking a
#: thread is a system call (several us on a VM) on the scheduler's thread, and a woken writer would
#: compete for the GIL in the middle of the step instead of between steps
POLL_S: Final = 0.002
IDLE_POLL_S: Final = 0.05


class _Pending:
    """One page queued for writing: its payload is a span of the write ring (``ring_pos`` >= 0), or
    the slot of a dropped page handed to the writer (``parts``: where the slot of each pool is read,
    ``_tiers``' ``DetachedSlot``), given back to ``parked`` once sent."""

    __slots__ = ("block_key", "layer_group", "nbytes", "parked", "parts", "retention", "ring_pos", "slot")

    def __init__(
        self,
        block_key: bytes,
        layer_group: int,
        nbytes: int,
        ring_pos: int,
        parts: list[DetachedSlot] | None,
        parked: list[SlotId] | None,
        slot: SlotId,
        retention: Carried,
    ) -> None:
        self.block_key = block_key
        #: the block's retention (``ExpiryQueue.carried``), written in the value's header
        self.retention = retention
        self.layer_group = layer_group
        self.nbytes = nbytes
        self.ring_pos = ring_pos
        self.parts = parts
        self.parked = parked
        self.slot = slot


def populated_mapping(nbytes: int) -> mmap.mmap:
    """Anonymous memory of ``nbytes``, faulted in at once where the OS offers it (MAP_POPULATE)."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if populate:
        try:
            return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
        except OSError:
            pass
    return mmap.mmap(-1, nbytes)


class RemoteWriter(RemoteClient):
    """The write queue and its thread (see the module doc); ``RemoteStore`` adds the reads. The
    scheduler's thread reserves, fills and enqueues; the writer thread only pops the queue."""

    def __init__(self, cfg: RemoteCacheTierConfig, fingerprint: bytes, max_page_bytes: int) -> None:
        super().__init__(cfg, fingerprint, max_page_bytes)
        self._max_pending = cfg.max_pending_bytes
        self.queued_writes = 0
        self.dropped_on_queue = 0
        self.dropped_bytes_on_queue = 0
        # writer-thread counters
        self.written_pages = 0
        self.written_bytes = 0
        self.dropped_by_writer = 0
        self.dropped_bytes_by_writer = 0
        self.write_errors = 0
        #: end of the last span reserved in the write ring (a position that only grows)
        self._head = 0
        #: ring positions below this are free again (the writer sent or dropped what was there)
        self._done = 0
        #: handed-off slots queued, and finished by the writer
        self.slots_queued = 0
        self.slots_done = 0
        self._queue: deque[_Pending] = deque()
        #: the write queue's memory: a ring of ``max_pending_bytes``, mapped in full up front (a page
        #: fault on the scheduler's thread costs ~10 us on these VMs), reused from its start whenever
        #: the queue is empty
        self._ring = populated_mapping(cfg.max_pending_bytes)
        self._ring_view = memoryview(self._ring)
        self.backend.register(self._ring_view)
        self._wake = threading.Event()
        self._stopping = False
        #: started by ``RemoteStore`` once it is complete
        self._writer = threading.Thread(target=self._writer_loop, name="kvcm-remote-writer", daemon=True)

    @property
    def pending_bytes(self) -> int:
        """Ring bytes queued and not yet sent (or dropped) by the writer."""
        return self._head - self._done

    @property
    def idle(self) -> bool:
        """Nothing queued or being sent."""
        return self._head == self._done and self.slots_queued == self.slots_done

    def reserve(self, nbytes: int) -> int:
        """Room for one value of ``nbytes`` in the write ring: its position (fill ``span(pos, nbytes)``
        then ``enqueue``), or -1 when the queue is full or the server counts as down (counted as a
        dropped write). Never blocks."""
        cap = self._max_pending
        pos = self._head
        off = pos % cap
        if off and pos == self._done:
            # nothing in flight (the writer is done with every span): start again at the ring's
            # beginning, so only its high-water mark is ever mapped
            pos += cap - off
            self._head = self._done = pos
        elif off + nbytes > cap:  # does not fit before the end of the ring: start the next lap
            pos += cap - off
        if pos + nbytes - self._done > cap or self._stopping or time.monotonic() < self._down_until:
            self.dropped_on_queue += 1
            self.dropped_bytes_on_queue += nbytes
            return -1
        self._head = pos + nbytes
        return pos

    def span(self, pos: int, nbytes: int) -> memoryview:
        off = pos % self._max_pending
        return self._ring_view[off : off + nbytes]

    def enqueue(self, pos: int, nbytes: int, block_key: bytes, layer_group: int, retention: Carried) -> None:
        """Hand a filled ring span (``reserve``) to the writer (``retention``: the block's, for the
        header). An empty ``block_key`` gives the span back unused (a failed copy)."""
        if block_key:
            self.queued_writes += 1
        else:
            self.dropped_on_queue += 1
            self.dropped_bytes_on_queue += nbytes
        self._queue.append(_Pending(block_key, layer_group, nbytes, pos, None, None, SlotId(-1), retention))

    def accepts_slot(self) -> bool:
        """Whether a handed-off slot would be sent now (not while the server counts as down)."""
        return not self._stopping and time.monotonic() >= self._down_until

    def enqueue_slot(
        self,
        block_key: bytes,
        layer_group: int,
        parts: list[DetachedSlot],
        nbytes: int,
        parked: list[SlotId],
        slot: SlotId,
        retention: Carried,
    ) -> None:
        """Hand the slot of a dropped page to the writer (no copy here): it sends the slot's bytes
        straight from ``parts`` and then appends ``slot`` to ``parked``."""
        self.queued_writes += 1
        self.slots_queued += 1
        self._queue.append(_Pending(block_key, layer_group, nbytes, -1, parts, parked, slot, retention))

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued write is finished (written or dropped); False on timeout."""
        deadline = time.monotonic() + timeout_s
        self._wake.set()  # no need to wait for the writer's next poll
        while not self.idle:
            if time.monotonic() >= deadline or not self._writer.is_alive():
                return False
            time.sleep(0.001)
        return True

    def _writer_loop(self) -> None:
        queue = self._queue
        poll = IDLE_POLL_S
        while True:
            self._wake.wait(poll)  # (flush and close set it)
            self._wake.clear()
            poll = POLL_S if queue else min(IDLE_POLL_S, 2 * poll)
            while queue:
                batch: list[_Pending] = []
                nbytes = 0
                while queue and len(batch) < BATCH_PAGES and nbytes < BATCH_BYTES:
                    w = queue.popleft()
                    if w.block_key:
                        batch.append(w)
                        nbytes += w.nbytes
                    else:
                        self._done = w.ring_pos + w.nbytes  # an abandoned span
                if not batch:
                    continue
                try:
                    self._write_batch(batch)
                except BaseException as e:  # never let the thread die (it would stall flush)
                    forget_frames(e)
                    self._dropped(batch)
                    LOG.error("remote KV tier writer: unexpected %s: %s", type(e).__name__, str(e))
                self._finished(batch)
            if self._stopping:
                return

    def _finished(self, batch: list[_Pending]) -> None:
        """Nothing reads the batch's memory any more: ring spans are free, handed-off slots parked."""
        for w in batch:
            if w.ring_pos >= 0:
                self._done = w.ring_pos + w.nbytes
            else:
                parked = w.parked
                assert parked is not None
                w.parts = None
                parked.append(w.slot)
                self.slots_done += 1

    def _payload(self, write: _Pending) -> list[memoryview]:
        if write.ring_pos >= 0:
            return [self.span(write.ring_pos, write.nbytes)]
        parts = write.parts
        assert parts is not None
        return [part.read() for part in parts]

    def _write_batch(self, batch: list[_Pending]) -> None:
        """Send ``batch`` in one backend call, each value (header, then the page's bytes where they
        lie: the ring, or the dropped pages' slots) written whole."""
        if self.is_down:
            self._dropped(batch)
            return
        fp = self.fingerprint
        sent: list[_Pending] = []
        keys: list[bytes] = []
        values: list[list[Any]] = []
        for w in batch:
            try:
                payload = self._payload(w)
            except OSError as e:  # a disk read failed or did not verify: this page is not written
                forget_frames(e)
                self._dropped([w])
                if w.parts:
                    w.parts[0].failed()
                continue
            sent.append(w)
            keys.append(self.page_key(w.block_key, w.layer_group))
            values.append([encode_header(payload, w.layer_group, fp, w.block_key, w.retention), *payload])
        if not sent:
            return
        results: list[Any] = []
        try:
            self.backend.write(keys, values, results)
        except self._errors as e:
            forget_frames(e)
            self._outcomes(sent, results)
            self._dropped(sent[len(results) :])
            self.write_errors += 1
            self._failed("write", e)
            return
        self._outcomes(sent, results)
        self._succeeded()

    def _outcomes(self, sent: list[_Pending], results: list[Any]) -> None:
        """Count the backend's result for each page of ``sent`` that has one."""
        for w, outcome in zip(sent, results):
            if outcome is True:
                self._written([w])
            else:
                self._dropped([w])
                if isinstance(outcome, BaseException):
                    self._refused(outcome)

    def _written(self, writes: list[_Pending]) -> None:
        self.written_pages += len(writes)
        self.written_bytes += sum(HEADER_BYTES + w.nbytes for w in writes)

    def _dropped(self, writes: list[_Pending]) -> None:
        self.dropped_by_writer += len(writes)
        self.dropped_bytes_by_writer += sum(HEADER_BYTES + w.nbytes for w in writes)
