"""Copies ordered against the engine's streams by events, never by synchronising the device.

The manager's copies run on the backend's own stream (``COPY_STREAM``). The pages they read or
write were last used by kernels on the engine's streams: the ``cuda_stream`` of the requests
that own them, or owned them and let go (close, or a new ``cuda_stream``). ``StreamOrder`` counts
the engine streams of the open requests (a request counts from its first ``resume`` to its
close) and keeps an event recorded on each stream the last request let go of, until a copy has
waited for it (the engine may destroy that stream meanwhile). Around a batch of copies touching
GPU memory:

- ``before``: an event recorded on every stream in use, and on the copy stream a wait for each of
  them and for the events of the streams let go of (the copies start after those kernels; the
  CPU does not wait).
- ``after``: an event recorded on the copy stream, and a wait for it on every stream in use (their
  next kernels, which read onboarded pages or write slots just copied out, start after the copies).

A stream that comes into use waits for the last copies too (a request resumed on a new stream
reads the pages its resume brought up). The CPU touches host memory an issued copy may use only
after ``MemoryBackend.wait_copies`` (our stream, not the device). On a synchronous backend (the
host-emulated one) all of this does nothing.
"""

from __future__ import annotations

from ._backend import COPY_STREAM, MemoryBackend


class StreamOrder:
    """The engine streams in use and the events that order the copy stream against them."""

    def __init__(self, backend: MemoryBackend) -> None:
        self.backend = backend
        #: events are needed (the backend's copies are asynchronous)
        self.active = backend.asynchronous
        #: open requests per engine stream (``CUstream`` handle; 0 the legacy default stream)
        self.users: dict[int, int] = {}
        #: each stream's event, recorded again before every batch (a queued wait keeps the record
        #: it was queued after, so one event per stream is enough)
        self.events: dict[int, object] = {}
        #: events recorded on streams no request uses any more, not yet waited for by a copy
        self.released: list[object] = []
        #: events no stream owns, for reuse
        self.spare: list[object] = []
        #: recorded on the copy stream after each batch; None until the first batch
        self.done: object = None

    def _event(self) -> object:
        spare = self.spare
        return spare.pop() if spare else self.backend.create_event()

    def acquire(self, stream: int) -> None:
        """A request's kernels run on ``stream`` from now on (until ``release``). A stream new to us
        first waits for the copies issued so far."""
        if not self.active:
            return
        n = self.users.get(stream, 0)
        self.users[stream] = n + 1
        if n == 0 and self.done is not None:
            self.backend.wait_event(stream, self.done)

    def release(self, stream: int) -> None:
        """A request no longer runs kernels on ``stream`` (closed, or moved to another stream). When
        it was the last, an event recorded there now keeps the next copy after its kernels."""
        if not self.active:
            return
        n = self.users[stream] - 1
        if n:
            self.users[stream] = n
            return
        del self.users[stream]
        event = self.events.pop(stream, None)
        if event is None:
            event = self._event()
        self.backend.record_event(event, stream)
        self.released.append(event)

    def before(self) -> None:
        """The copy stream's next copies wait for the kernels queued so far on every stream in use
        and on the streams let go of since the last batch."""
        if not self.active:
            return
        backend = self.backend
        events = self.events
        for stream in self.users:
            event = events.get(stream)
            if event is None:
                event = events[stream] = self._event()
            backend.record_event(event, stream)
            backend.wait_event(COPY_STREAM, event)
        released = self.released
        if released:
            for event in released:
                backend.wait_event(COPY_STREAM, event)
            self.spare.extend(released)  # (the copy stream waits in order: once is enough)
            released.clear()

    def after(self) -> None:
        """Every stream in use waits for the copies queued so far."""
        if not self.active:
            return
        backend = self.backend
        done = self.done
        if done is None:
            done = self.done = backend.create_event()
        backend.record_event(done, COPY_STREAM)
        for stream in self.users:
            backend.wait_event(stream, done)

    def close(self) -> None:
        """At shutdown (no request open): wait until the copies and the kernels of the streams let
        go of are done (their pools are given back next; our stream, never the device), then give
        back every event. Idempotent."""
        if self.active and (self.released or self.done is not None):
            self.before()
            self.backend.synchronize()
        events = list(self.events.values()) + self.released + self.spare
        if self.done is not None:
            events.append(self.done)
        self.events = {}
        self.released = []
        self.spare = []
        self.done = None
        for event in events:
            self.backend.destroy_event(event)
        self.active = False  # (a cache closing after shutdown has nothing to order)
