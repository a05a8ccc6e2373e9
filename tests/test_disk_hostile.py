"""A persistent disk tier's directory as a crash, an attacker or a careless operator may leave it:
records with valid checksums that do not form a tree, a forked child that outlives its parent,
symbolic links, directories and FIFOs named like our files, files that are not ours, a disk that
refuses record writes. None may crash the manager, leak a slot, follow a link or delete a file
that is not ours (issue 38)."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
from typing import Any

import pytest
from test_disk_persistent import WORKER, config, published_directory, reused
from tier_helpers import T, publish, seq

from kv_cache_manager_v2 import CacheLevel, KVCacheManager, LogicError, ReuseScope
from kv_cache_manager_v2._reuse._keys import block_key, scope_key
from kv_cache_manager_v2._storage._disk import checksum
from kv_cache_manager_v2._storage._persist import HEADER_BYTES, RECORD_HEAD, RECORD_MAGIC

DISK = CacheLevel(1)
SLOTS = "kvcm-g0.slots"
POOL = "kvcm-g0-p0.pool"
LOCK = "kvcm-disk.lock"


def records(path: str, num_slots: int = 32) -> dict[int, list[Any]]:
    """The valid-looking records of pool group 0 (slot -> fields of ``RECORD_HEAD``)."""
    name = os.path.join(path, SLOTS)
    size = (os.path.getsize(name) - HEADER_BYTES) // num_slots
    out: dict[int, list[Any]] = {}
    with open(name, "rb") as f:
        f.seek(HEADER_BYTES)
        for slot in range(num_slots):
            fields = list(RECORD_HEAD.unpack_from(f.read(size)))
            if fields[0] == RECORD_MAGIC:
                out[slot] = fields
    return out


def rewrite(path: str, slot: int, num_slots: int = 32, to: int | None = None, **change: Any) -> None:
    """Change fields of ``slot``'s record (``flags``, ``lora_id``, ``seq``, ``parent``, ``key``) and
    give it a valid checksum again, in place or into slot ``to``: a record as a bug or an attacker
    could write it."""
    name = os.path.join(path, SLOTS)
    size = (os.path.getsize(name) - HEADER_BYTES) // num_slots
    index = {"flags": 1, "lora_id": 6, "seq": 8, "parent": 9, "key": 10}
    with open(name, "r+b") as f:
        f.seek(HEADER_BYTES + slot * size)
        rec = bytearray(f.read(size))
        fields = list(RECORD_HEAD.unpack_from(rec))
        for field, value in change.items():
            fields[index[field]] = value
        RECORD_HEAD.pack_into(rec, 0, *fields)
        rec[size - 4 :] = checksum(memoryview(rec)[: size - 4]).to_bytes(4, "little")
        f.seek(HEADER_BYTES + (slot if to is None else to) * size)
        f.write(rec)


def leaves(path: str) -> list[int]:
    """Slots of the records no other record names as its parent, by slot."""
    found = records(path)
    parents = {fields[9] for fields in found.values()}
    return sorted(slot for slot, fields in found.items() if fields[10] not in parents)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# ---------------------------------------------------------------- item 4: the adopted graph
@pytest.mark.parametrize("kind", ["self_parent", "cycle", "root_key", "other_scope"])
def test_records_that_do_not_form_a_tree_are_ignored_once_and_their_slots_reclaimed(
    tmp_path: Any, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    path = str(tmp_path)
    prompts = published_directory(path)
    ends = leaves(path)
    assert len(ends) == 4
    found = records(path)
    bad = ends[:1]
    if kind == "self_parent":
        rewrite(path, ends[0], parent=found[ends[0]][10])
    elif kind == "cycle":
        bad = ends[:2]
        rewrite(path, ends[0], parent=found[ends[1]][10])
        rewrite(path, ends[1], parent=found[ends[0]][10])
    elif kind == "root_key":
        rewrite(path, ends[0], key=scope_key(ReuseScope()))
    else:  # a block of another scope under a block of the default one
        rewrite(path, ends[0], flags=1, lora_id=5)
    with caplog.at_level(logging.WARNING, logger="kv_cache_manager_v2"):
        m2 = KVCacheManager(config(path))
    try:
        said = warnings_of(caplog)
        assert len(said) == 1 and f"{len(bad)} record(s)" in said[0], said
        assert m2.num_adopted_pages == 8 - len(bad)
        m2.check_invariants()  # every slot taken at start-up is a page or free again
        assert m2.get_storage_statistics(DISK)[0].free == 32 - (8 - len(bad))
        assert sum(reused(m2, toks) for toks in prompts) == (8 - len(bad)) * T  # a bad leaf: its prompt keeps one block
    finally:
        m2.shutdown()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kv_cache_manager_v2"):
        m3 = KVCacheManager(config(path))  # the ignored records were erased: no second warning
    try:
        assert warnings_of(caplog) == [] and m3.num_adopted_pages == 8 - len(bad)
        m3.check_invariants()
    finally:
        m3.shutdown()


def test_an_older_record_of_a_page_written_again_is_superseded_quietly(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A page that left the disk and came back to another slot leaves its old record behind (a
    freed slot keeps its record until it is written again): at start-up the newest record is
    the page, the older one's slot is free again and its record erased, with no warning."""
    path = str(tmp_path)
    prompts = published_directory(path)
    found = records(path)
    leaf = leaves(path)[0]
    free = next(slot for slot in range(32) if slot not in found)
    rewrite(path, leaf, to=free, seq=found[leaf][8] - 1)  # the same record, written before the one in ``leaf``
    for _ in range(2):  # the second start-up: the reuse checks above wrote pages again, elsewhere
        with caplog.at_level(logging.WARNING, logger="kv_cache_manager_v2"):
            m2 = KVCacheManager(config(path))
        try:
            assert warnings_of(caplog) == [] and m2.num_adopted_pages == 8
            m2.check_invariants()
            assert m2.get_storage_statistics(DISK)[0].free == 32 - 8
            assert sum(reused(m2, toks) for toks in prompts) == 8 * T  # read from the newest slot
        finally:
            m2.shutdown()
        caplog.clear()


@pytest.mark.parametrize("seed", range(6))
def test_records_rewired_at_random_never_crash_nor_leak(tmp_path: Any, seed: int) -> None:
    """Every record's parent (and some keys) replaced by a random choice among the keys present,
    the scope's root, itself and a key nobody has: whatever graph results, the manager opens,
    every slot is a page or free, and what is served is exactly what was written."""
    path = str(tmp_path)
    rng = random.Random(seed)
    prompts = [seq(r, 3 * T) for r in range(6)]
    m = KVCacheManager(config(path, gpu=4, disk=32))
    for toks in prompts:
        publish(m, toks)
    m.shutdown()
    found = records(path)
    keys = [fields[10] for fields in found.values()]
    choices = [*keys, scope_key(ReuseScope()), bytes(32)]
    for slot, fields in found.items():
        change: dict[str, Any] = {}
        if rng.random() < 0.5:
            change["parent"] = rng.choice([*choices, fields[10]])
        if rng.random() < 0.15:
            change["key"] = rng.choice(choices)
        if change:
            rewrite(path, slot, **change)
    m2 = KVCacheManager(config(path, gpu=4, disk=32))
    try:
        m2.check_invariants()
        assert m2.get_storage_statistics(DISK)[0].free == 32 - m2.num_adopted_pages
        for toks in prompts:
            reused(m2, toks)  # every record of what is reused checked through the fake engine
    finally:
        m2.shutdown()
    KVCacheManager(config(path, gpu=4, disk=32)).shutdown()


def test_a_record_file_cut_inside_a_record_keeps_the_records_before_the_cut(tmp_path: Any) -> None:
    path = str(tmp_path)
    m = KVCacheManager(config(path))
    for r in range(4):
        publish(m, seq(r, 2 * T))
    m.shutdown()
    name = os.path.join(path, SLOTS)
    size = (os.path.getsize(name) - HEADER_BYTES) // 32
    cut = max(records(path)) * size + size // 2  # inside the last record
    os.truncate(name, HEADER_BYTES + cut)
    m2 = KVCacheManager(config(path))
    try:
        assert m2.num_adopted_pages >= 1
        m2.check_invariants()
        assert sum(reused(m2, seq(r, 2 * T)) for r in range(4)) == m2.num_adopted_pages * T
    finally:
        m2.shutdown()


# ------------------------------------------- issue 47: records consistent with themselves only
@pytest.mark.parametrize("where", ["leaf", "inner"])
def test_a_record_hung_under_another_real_block_is_ignored(
    tmp_path: Any, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """A record whose parent is changed to another block on disk (its key, tokens and checksum
    valid) forms a tree, but its key is not SHA-256(parent key + tokens): ignored (with what hangs
    under it), so prompt 1's first block followed by prompt 0's second is not served prompt 0's
    second page (it was computed after prompt 0's first block)."""
    path = str(tmp_path)
    prompts = published_directory(path)
    root = scope_key(ReuseScope())
    first = [block_key(root, toks[:T]) for toks in prompts]
    second = [block_key(first[r], toks[T:]) for r, toks in enumerate(prompts)]
    slot_of = {fields[10]: slot for slot, fields in records(path).items()}
    if where == "leaf":  # prompt 0's second block under prompt 1's first
        rewrite(path, slot_of[second[0]], parent=first[1])
        mixed, bad, kept = prompts[1][:T] + prompts[0][T:], 1, [T, 2 * T, 2 * T, 2 * T]
    else:  # prompt 0's first block under prompt 1's second: its own child goes with it
        rewrite(path, slot_of[first[0]], parent=second[1])
        mixed, bad, kept = prompts[1] + prompts[0][:T], 2, [0, 2 * T, 2 * T, 2 * T]
    with caplog.at_level(logging.WARNING, logger="kv_cache_manager_v2"):
        m2 = KVCacheManager(config(path))
    try:
        said = warnings_of(caplog)
        assert len(said) == 1 and f"{bad} record(s)" in said[0] and "key" in said[0], said
        assert m2.num_adopted_pages == 8 - bad
        m2.check_invariants()
        assert m2.get_storage_statistics(DISK)[0].free == 32 - (8 - bad)
        assert reused(m2, mixed) == len(mixed) - T
        assert [reused(m2, toks) for toks in prompts] == kept
    finally:
        m2.shutdown()


@pytest.mark.parametrize("big", [2**63, 2**64 - 1])
def test_a_record_with_an_impossible_write_sequence_is_ignored_and_later_writes_order_after_the_rest(
    tmp_path: Any, caplog: pytest.LogCaptureFixture, big: int
) -> None:
    """A write sequence of 2**63 or more (no manager writes that many records) made the next
    record's sequence overflow its 8 bytes: ``struct.error`` out of ``KVCache.resize`` when eviction
    moved a page to the disk tier, and again from ``shutdown``'s write-back. Such a record is
    ignored (with one warning) and erased; the records written later have sequences above every
    record kept, so a restart adopts them in write order."""
    path = str(tmp_path)
    published_directory(path)
    found = records(path)
    leaf = leaves(path)[0]
    rewrite(path, leaf, seq=big)
    kept = {fields[8] for slot, fields in found.items() if slot != leaf}
    with caplog.at_level(logging.WARNING, logger="kv_cache_manager_v2"):
        m2 = KVCacheManager(config(path))
    try:
        said = warnings_of(caplog)
        assert len(said) == 1 and "1 record(s)" in said[0] and "sequence" in said[0], said
        assert m2.num_adopted_pages == 7
        m2.check_invariants()
        for r in range(4, 8):  # four GPU slots: the older prompts' blocks go down to the disk tier
            publish(m2, seq(r, 2 * T))
        m2.check_invariants()
    finally:
        m2.shutdown()  # writes the GPU's blocks back
    after = records(path)
    assert after.get(leaf, [None] * 9)[8] != big  # erased (or written again)
    written = sorted(fields[8] for fields in after.values() if fields[8] not in kept)
    assert written and written[0] > max(kept) and written[-1] < 2**63
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kv_cache_manager_v2"):
        m3 = KVCacheManager(config(path))
    try:
        assert warnings_of(caplog) == [] and m3.num_adopted_pages == len(after)
        m3.check_invariants()
        assert [reused(m3, seq(r, 2 * T)) for r in range(8)] == [T, *[2 * T] * 7]
    finally:
        m3.shutdown()


def test_a_record_with_the_last_valid_write_sequence_is_adopted_and_writing_goes_on(tmp_path: Any) -> None:
    """Just below the limit (2**63 - 1): adopted; the next records take 2**63, 2**63 + 1, ..."""
    path = str(tmp_path)
    published_directory(path)
    leaf = leaves(path)[0]
    rewrite(path, leaf, seq=2**63 - 1)
    m2 = KVCacheManager(config(path))
    try:
        assert m2.num_adopted_pages == 8
        for r in range(4, 8):
            publish(m2, seq(r, 2 * T))
        m2.check_invariants()
    finally:
        m2.shutdown()
    newer = sorted(fields[8] for fields in records(path).values() if fields[8] >= 2**63 - 1)
    assert newer[0] == 2**63 - 1 and len(newer) > 1 and newer[1] == 2**63


# ---------------------------------------------------------------- item 5: forked children
def test_a_forked_child_does_not_keep_the_directory_locked(tmp_path: Any) -> None:
    """The child even shuts its copy of the manager down: that writes nothing to the parent's files."""
    path = str(tmp_path)
    m = KVCacheManager(config(path))
    publish(m, seq(1, 2 * T))  # on the GPU: a shutdown would write it back to disk

    def contents() -> list[bytes]:
        out = []
        for name in (POOL, SLOTS):
            with open(os.path.join(path, name), "rb") as f:
                out.append(f.read())
        return out

    before = contents()
    done_r, done_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 0
        try:
            m.shutdown()
        except BaseException:
            code = 1
        os.write(done_w, b"x")
        os.read(go_r, 1)  # lives on until the parent's word
        os._exit(code)
    try:
        assert os.read(done_r, 1) == b"x"
        assert contents() == before
        with pytest.raises(LogicError, match=f"process {os.getpid()} holds"):
            KVCacheManager(config(path))  # refused while the parent holds it: the error names it
        m.shutdown()
        m2 = KVCacheManager(config(path))  # the child still lives
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)
        assert m2.num_adopted_pages == 2 and reused(m2, seq(1, 2 * T)) == 2 * T
        m2.shutdown()
    finally:
        os.write(go_w, b"x")
        assert os.waitpid(pid, 0)[1] == 0
        for fd in (done_r, done_w, go_r, go_w):
            os.close(fd)


def test_a_child_forked_by_a_killed_process_does_not_keep_the_directory_locked(tmp_path: Any) -> None:
    """A process with a ``multiprocessing`` "fork" child is killed with SIGKILL: the directory can
    be opened at once, while the child lives on."""
    path = str(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, WORKER, json.dumps({"mode": "fork", "path": path, "prompts": [seq(1, 2 * T)]})],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    child = -1
    try:
        assert holder.stdout is not None
        word, pid = holder.stdout.readline().split()
        assert word == "ready"
        child = int(pid)
        with pytest.raises(LogicError, match=f"process {holder.pid} holds"):
            KVCacheManager(config(path))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    try:
        os.kill(child, 0)  # alive
        m = KVCacheManager(config(path))
        assert m.num_adopted_pages == 2 and reused(m, seq(1, 2 * T)) == 2 * T
        m.shutdown()
    finally:
        if child > 0:
            os.kill(child, signal.SIGKILL)


# ---------------------------------------------------------------- items 6 and 8: names
@pytest.mark.parametrize("name", [LOCK, SLOTS, POOL])
@pytest.mark.parametrize("dangling", [False, True])
def test_symlinks_named_like_our_files_are_refused_and_their_targets_untouched(
    tmp_path: Any, name: str, dangling: bool
) -> None:
    path = str(tmp_path / "tier")
    os.mkdir(path)
    m = KVCacheManager(config(path))  # a directory in use before: every file holds something
    publish(m, seq(1, 2 * T))
    m.shutdown()
    target = str(tmp_path / "precious")
    if not dangling:
        with open(target, "wb") as f:
            f.write(b"precious " * 1000)
    os.unlink(os.path.join(path, name))
    os.symlink(target, os.path.join(path, name))
    before = {n: os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n != name}
    for namespace in ("", "another-model"):  # ours, and one whose files would be reset
        with pytest.raises(ValueError, match=re.escape(os.path.join(path, name)) + ".*symbolic link"):
            KVCacheManager(config(path, namespace=namespace))
    if dangling:
        assert not os.path.lexists(target)
    else:
        with open(target, "rb") as f:
            assert f.read() == b"precious " * 1000
    assert {n: os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n != name} == before
    os.unlink(os.path.join(path, name))
    KVCacheManager(config(path)).shutdown()  # the lock was given back


@pytest.mark.parametrize("name", [LOCK, SLOTS, POOL])
def test_a_hard_link_named_like_our_files_is_refused_and_its_other_name_untouched(tmp_path: Any, name: str) -> None:
    path = str(tmp_path / "tier")
    os.mkdir(path)
    other = str(tmp_path / "precious")
    with open(other, "wb") as f:
        f.write(b"precious " * 1000)
    os.link(other, os.path.join(path, name))
    with pytest.raises(ValueError, match=re.escape(os.path.join(path, name)) + ".*1 other hard link"):
        KVCacheManager(config(path))
    with open(other, "rb") as f:
        assert f.read() == b"precious " * 1000


@pytest.mark.parametrize("name", [LOCK, SLOTS, POOL, "kvcm-g3.slots"])
@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_directory_or_fifo_named_like_our_files_is_a_clear_error_or_left_alone(
    tmp_path: Any, name: str, kind: str
) -> None:
    path = str(tmp_path)
    where = os.path.join(path, name)
    if kind == "directory":
        os.mkdir(where)
        with open(os.path.join(where, "inside"), "wb") as f:
            f.write(b"x")
    else:
        os.mkfifo(where)
    if name == "kvcm-g3.slots":  # a name of our format this layout does not use: not ours to touch
        KVCacheManager(config(path)).shutdown()
    else:
        what = "a directory" if kind == "directory" else "a FIFO"
        with pytest.raises(ValueError, match=re.escape(where) + f".*{what}"):
            KVCacheManager(config(path))
    assert os.path.isdir(where) if kind == "directory" else os.path.exists(where)


def test_start_up_deletes_only_exact_names_of_our_format(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    path = str(tmp_path)
    m = KVCacheManager(config(path, layers=None))
    publish(m, seq(1, 2 * T))
    m.shutdown()
    keep = ["kvcm-g0-p0.pool.bak", "kvcm-g0.slots~", "kvcm-g00.slots", "kvcm-g1-p01.pool", "kvcm-g2.notes", "kvcm-g"]
    stale = ["kvcm-g1.slots", "kvcm-g1-p0.pool", "kvcm-g0-p3.pool"]  # groups and pools this layout lacks
    for name in keep + stale:
        with open(os.path.join(path, name), "wb") as f:
            f.write(name.encode())
    with caplog.at_level(logging.WARNING, logger="kv_cache_manager_v2"):
        m2 = KVCacheManager(config(path))
    try:
        assert m2.num_adopted_pages == 2
        said = warnings_of(caplog)
        assert len(said) == 1 and "ignored 3 file(s)" in said[0], said
    finally:
        m2.shutdown()
    assert sorted(os.listdir(path)) == sorted([LOCK, POOL, SLOTS, *keep])
    for name in keep:
        with open(os.path.join(path, name), "rb") as f:
            assert f.read() == name.encode()


# ---------------------------------------------------------------- item 7: record writes that fail
def test_the_record_file_is_allocated_up_front(tmp_path: Any) -> None:
    """Records are written while serving: their space is taken at start-up (as the data files'
    is), so a disk that fills up later cannot refuse them."""
    path = str(tmp_path)
    m = KVCacheManager(config(path, disk=512))
    try:
        st = os.stat(os.path.join(path, SLOTS))
        assert st.st_size > HEADER_BYTES + 512 * 100 and st.st_blocks * 512 >= st.st_size
    finally:
        m.shutdown()


def fail_record_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make every write to a record file fail as on a full disk (data files are written as usual);
    returns the count of failed writes, kept up to date (``monkeypatch.undo()`` ends it)."""
    real = os.pwrite
    failed = [0]

    def full(fd: int, data: Any, offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".slots"):
            failed[0] += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    return failed


def test_failed_record_writes_are_counted_and_warned_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path)
    m = KVCacheManager(config(path, gpu=4, disk=32))
    failed = fail_record_writes(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="kv_cache_manager_v2"):
        for r in range(4):
            publish(m, seq(r, 2 * T))  # the older prompts' blocks go down to the disk tier
        assert failed[0] >= 4
        assert m.get_tier_statistics(DISK).io_errors == failed[0]
        assert m.take_iteration_stats()[1].io_errors == failed[0]
        m.shutdown()  # the rest is written back: its records fail too
    monkeypatch.undo()
    assert failed[0] >= 8
    said = [s for s in warnings_of(caplog) if "record" in s]
    assert len(said) == 1 and path in said[0] and "No space left" in said[0], said
    m2 = KVCacheManager(config(path, gpu=4, disk=32))
    try:
        assert m2.num_adopted_pages == 0  # nothing was recorded
    finally:
        m2.shutdown()
