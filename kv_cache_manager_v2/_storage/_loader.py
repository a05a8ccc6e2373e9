"""Background reads: a small bounded pool of worker threads that run I/O jobs (a disk pread of a
page's slot bytes, a remote lookup or fetch) into buffers the job owns, off the scheduler's thread.

Workers never touch the manager's state: a job's ``run`` reads into its own buffers (the file's
pread and the socket release the GIL) and keeps its result; the scheduler's thread collects the
finished jobs (``finished``) and installs them, checking each is still wanted (see
``_storage/_page_reads.py``, ``_core/_prefetch.py``). A cancelled job is simply never installed.
``manual`` (tests) keeps submitted jobs queued until ``run_queued`` runs one on the caller's
thread, in any order the test picks.
"""

from __future__ import annotations

import logging
import queue
import threading


class LoadJob:
    """One background read. ``run`` (on a worker) fills the job's own fields; everything else is
    the scheduler's thread's."""

    def __init__(self) -> None:
        #: set by ``BackgroundLoader.cancel``: the result is discarded when it arrives
        self.cancelled = False
        #: set once ``run`` returned (read on the scheduler's thread after ``finished`` hands it over)
        self.finished = False

    def run(self) -> None:
        """The I/O, on a worker thread: never raises (a failure is a result), never touches shared state."""
        raise NotImplementedError

    def land(self) -> None:
        """On the scheduler's thread once ``run`` finished (never for a cancelled job): use the result."""


class BackgroundLoader:
    """``workers`` daemon threads (started on the first job) over one job queue; finished jobs come
    back in completion order through ``finished``. Not thread-safe on the submitting side (the
    scheduler's thread only)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._jobs: queue.SimpleQueue[LoadJob | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[LoadJob] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        #: jobs submitted and not yet collected by ``finished`` (cancelled ones included)
        self.in_flight = 0
        #: tests: jobs wait here until ``run_queued`` (no thread runs them)
        self.manual = False
        self.queued: list[LoadJob] = []
        self.closed = False

    def submit(self, job: LoadJob) -> None:
        """Queue ``job`` for a worker (starting the workers on first use)."""
        self.in_flight += 1
        if self.manual:
            self.queued.append(job)
            return
        if not self._threads:
            for i in range(self.workers):
                t = threading.Thread(target=_work, args=(self._jobs, self._done), name=f"kvcm-load-{i}", daemon=True)
                t.start()
                self._threads.append(t)
        self._jobs.put(job)

    def run_queued(self, index: int) -> None:
        """Tests (``manual``): run queued job ``index`` now, on this thread."""
        job = self.queued.pop(index)
        if not job.cancelled:  # (as a worker: a cancelled job is skipped unread)
            _run(job)
        job.finished = True
        self._done.put(job)

    def finished(self) -> list[LoadJob]:
        """The jobs finished since the last call, in completion order (cancelled ones included)."""
        out: list[LoadJob] = []
        if self.in_flight == 0:
            return out
        done = self._done
        while True:
            try:
                job = done.get_nowait()
            except queue.Empty:
                break
            out.append(job)
        self.in_flight -= len(out)
        return out

    def close(self, timeout_s: float) -> bool:
        """Stop the workers (each finishes its current read first: bounded by the disk, and the
        remote tier's ``timeout_ms``); False when one did not stop within ``timeout_s`` (it may
        still read a file descriptor or socket the caller is about to close)."""
        if self.closed:
            return True
        self.closed = True
        for job in self.queued:
            job.cancelled = True
        self.queued = []
        for _ in self._threads:
            self._jobs.put(None)
        ok = True
        for t in self._threads:
            t.join(timeout_s)
            ok = ok and not t.is_alive()
        return ok


def _work(jobs: queue.SimpleQueue[LoadJob | None], done: queue.SimpleQueue[LoadJob]) -> None:
    """A worker: run jobs until the ``None`` sentinel; a cancelled job is skipped unread."""
    while True:
        job = jobs.get()
        if job is None:
            return
        if not job.cancelled:
            _run(job)
        job.finished = True
        done.put(job)


def _run(job: LoadJob) -> None:
    """``job.run()``; a job that raises anyway (a bug) keeps its default result: a miss."""
    try:
        job.run()
    except Exception:
        logging.getLogger("kv_cache_manager_v2").exception("a background load raised; its pages are misses")
