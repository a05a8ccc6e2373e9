"""The persistent disk tier's files (``DiskCacheTierConfig(persistent=True)``): a lock, per pool group
one data file per pool and one file of slot records, so a new manager with the same layout adopts
the published blocks a previous one left there.

Files in the tier's directory:

- ``kvcm-disk.lock``: ``flock``-ed by the manager using the directory; a second opener is refused.
  A process forked from it closes its copies of the lock and records at once (``register_at_fork``):
  a child never keeps the directory locked after its parent is gone.
- ``kvcm-g<group>-p<pool>.pool``: the slots' bytes (as in a private disk pool).
- ``kvcm-g<group>.slots``: a 4 KiB header (magic, format version, checksum algorithm, pool group,
  layout fingerprint, namespace digest, slot sizes digest, record size, tokens per block), then one
  fixed-size record per slot: magic, scope (LoRA id, salt), layer group, priority, retention
  (priority, wall-clock expiry, duration, hint: ``ExpiryQueue.carried``), write sequence, parent
  and block keys, the checksum of the slot's bytes in each pool, the block's token ids, and the
  record's own checksum.

Crash safety needs no ``fsync`` ordering: a slot's bytes are written before its record, a record
is valid only when its own checksum matches, and a slot is served only when its bytes match the
checksum its record names (verified at every read). A process killed anywhere leaves each slot
old-and-valid or unusable (a miss), never torn-and-served. A file of another layout, format version,
checksum algorithm or namespace is ignored (one warning) and overwritten.

Only exact names of this format are ever opened, truncated or deleted, and only as regular files:
a symbolic link, directory, FIFO, device or file with other hard links named like one is refused
(``ValueError`` naming it), and other files (``kvcm-g0-p0.pool.bak``) are left alone.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import struct
from array import array
from typing import Final

import rawref

from .._config import DiskCacheTierConfig
from .._exceptions import LogicError, OutOfMemoryError
from ._disk import CHECKSUM_IDS, CHECKSUM_NAME, allocate, checksum, open_file, refuse_unusable

LOG = logging.getLogger("kv_cache_manager_v2")

LOCK_NAME: Final = "kvcm-disk.lock"
FILE_MAGIC: Final = b"KVCMDSK\x00"
#: bump when the record or file layout changes
DISK_FORMAT_VERSION: Final = 2
#: magic, format version, checksum algorithm, pool group, layout fingerprint, namespace digest,
#: slot sizes digest, record size, tokens per block
FILE_HEADER: Final = struct.Struct("<8sHHI8s8s8sII")
#: records start here (one page: a record never shares a page with the header)
HEADER_BYTES: Final = 4096
RECORD_MAGIC: Final = b"KVR1"
#: magic, flags (1: LoRA id, 2: salt), priority (without retention), layer group, tokens, priority
#: under retention, reserved, LoRA id, salt, sequence, parent key, block key, retention's wall-clock
#: expiry, duration and hint end; then one checksum per pool, the token ids, the record checksum
RECORD_FORMAT: Final = "<4sBBHHBxQQQ32s32sddq"
RECORD_HEAD: Final = struct.Struct(RECORD_FORMAT)
#: a record's write sequence is below this (8 bytes on disk, and room for 2**63 more writes): one at
#: or above it is no write of ours, so adoption ignores it (``_reuse._adopt``)
SEQ_LIMIT: Final = 1 << 63
#: the names of the data and record files (``pool_file``, ``records_file``): nothing else is deleted
OUR_NAME: Final = re.compile(r"kvcm-g(?:0|[1-9][0-9]*)(?:-p(?:0|[1-9][0-9]*)\.pool|\.slots)")


def pool_file(path: str, group: int, pool: int) -> str:
    """The data file of ``pool`` of pool group ``group`` in a persistent tier's directory."""
    return os.path.join(path, f"kvcm-g{group}-p{pool}.pool")


def records_file(path: str, group: int) -> str:
    """The slot records of pool group ``group`` in a persistent tier's directory."""
    return os.path.join(path, f"kvcm-g{group}.slots")


def record_size(num_pools: int, tokens_per_block: int) -> int:
    """Bytes of one slot record (a multiple of 16)."""
    n = RECORD_HEAD.size + 4 * num_pools + 4 * tokens_per_block + 4
    return (n + 15) // 16 * 16


class DiskRecord:
    """One valid slot record read back: which published block's page the slot holds (``sums``: the
    checksum of each pool's bytes, 4 bytes little-endian each). Untracked by the cyclic GC (it holds
    no container), so adopting millions of them triggers no full collections."""

    __slots__ = (
        "expires",
        "group",
        "hint_end",
        "key",
        "layer_group",
        "lora_id",
        "parent",
        "priority",
        "retain_s",
        "retained_priority",
        "salt",
        "seq",
        "slot",
        "sums",
        "tokens",
    )

    def __init__(
        self,
        group: int,
        slot: int,
        layer_group: int,
        priority: int,
        lora_id: int | None,
        salt: int | None,
        seq: int,
        parent: bytes,
        key: bytes,
        sums: bytes,
        tokens: array[int],
        retention: tuple[int, float, float, int],
    ) -> None:
        self.group = group
        self.slot = slot
        self.layer_group = layer_group
        self.priority = priority
        self.lora_id = lora_id
        self.salt = salt
        self.seq = seq
        self.parent = parent
        self.key = key
        self.sums = sums
        self.tokens = tokens
        #: the retention it kept (``ExpiryQueue.carried``: priority, wall-clock expiry, duration, hint end)
        self.retained_priority = retention[0]
        self.expires = retention[1]
        self.retain_s = retention[2]
        self.hint_end = retention[3]


class _GroupFiles:
    """The record file of one pool group (open for the manager's lifetime)."""

    __slots__ = ("fd", "group", "num_pools", "num_slots", "record", "tokens_per_block")

    def __init__(self, fd: int, group: int, num_pools: int, num_slots: int, tokens_per_block: int) -> None:
        self.fd = fd
        self.group = group
        self.num_pools = num_pools
        self.num_slots = num_slots
        self.tokens_per_block = tokens_per_block
        self.record = record_size(num_pools, tokens_per_block)


class PersistentDisk:
    """The lock, record files and adoption state of one persistent disk tier.

    ``groups`` lists, per pool group, its slot sizes (one per pool) and slot count. Construction
    checks every path it will use (``ValueError`` naming one that is not a regular file), takes
    the lock (``LogicError`` naming the holder's pid if another manager has it), reads every
    compatible record file (``records[g]``: the valid records of slots below the slot count) and
    resets the others; the data files are then opened by the disk pools (``pool_path``).
    """

    def __init__(
        self,
        cfg: DiskCacheTierConfig,
        fingerprint: bytes,
        groups: list[tuple[tuple[int, ...], int]],
        tokens_per_block: int,
    ) -> None:
        self.path = cfg.path
        for g, (sizes, _) in enumerate(groups):  # before anything is touched
            refuse_unusable(records_file(cfg.path, g))
            for p in range(len(sizes)):
                refuse_unusable(pool_file(cfg.path, g, p))
        self.lock_fd = _take_lock(cfg.path)
        self.files: list[_GroupFiles] = []
        #: per pool group, the valid records loaded at start-up (emptied once adopted)
        self.records: list[list[DiskRecord]] = []
        #: write sequence of the next record (orders adopted pages oldest first)
        self.seq = 1
        #: record writes that failed (the slot is then just not persisted; the tier's io_errors)
        self.num_write_errors = 0
        self._namespace = hashlib.sha256(cfg.namespace.encode()).digest()[:8]
        self._fingerprint = fingerprint
        _OPEN[id(self)] = self
        ignored_files = ignored_records = 0
        try:
            for g, (sizes, num_slots) in enumerate(groups):
                files, found, foreign = self._open_group(g, sizes, num_slots, tokens_per_block)
                self.files.append(files)
                self.records.append(found)
                if foreign >= 0:
                    ignored_files += 1
                    ignored_records += foreign
            ignored_files += self._remove_stale(groups)
        except BaseException:
            self.release()
            raise
        for found in self.records:  # later records order after every one adopted
            for r in found:
                if self.seq <= r.seq < SEQ_LIMIT:
                    self.seq = r.seq + 1
        if ignored_files:
            LOG.warning(
                "persistent disk tier %s: ignored %d file(s) (%d record(s)) written with another layout, format "
                "version, checksum or namespace; their space is reclaimed",
                cfg.path,
                ignored_files,
                ignored_records,
            )

    def _remove_stale(self, groups: list[tuple[tuple[int, ...], int]]) -> int:
        """Delete the regular files named exactly like a data or record file that this layout
        lacks (other groups or pools); returns how many. Nothing else in the directory is touched."""
        ours = {os.path.basename(records_file(self.path, g)) for g in range(len(groups))}
        for g, (sizes, _) in enumerate(groups):
            ours.update(os.path.basename(pool_file(self.path, g, p)) for p in range(len(sizes)))
        removed = 0
        for name in os.listdir(self.path):
            if name in ours or OUR_NAME.fullmatch(name) is None:
                continue
            where = os.path.join(self.path, name)
            try:
                refuse_unusable(where)
            except ValueError:
                continue  # a link, directory, ... named like ours: not ours to delete
            os.unlink(where)
            removed += 1
        return removed

    def pool_path(self, group: int, pool: int) -> str:
        return pool_file(self.path, group, pool)

    def _header(self, group: int, sizes: tuple[int, ...], tokens_per_block: int) -> bytes:
        digest = hashlib.sha256(",".join(str(s) for s in sizes).encode()).digest()[:8]
        head = FILE_HEADER.pack(
            FILE_MAGIC,
            DISK_FORMAT_VERSION,
            CHECKSUM_IDS[CHECKSUM_NAME],
            group,
            self._fingerprint,
            self._namespace,
            digest,
            record_size(len(sizes), tokens_per_block),
            tokens_per_block,
        )
        return head + bytes(HEADER_BYTES - len(head))

    def _open_group(
        self, group: int, sizes: tuple[int, ...], num_slots: int, tokens_per_block: int
    ) -> tuple[_GroupFiles, list[DiskRecord], int]:
        """Open (or create) group ``group``'s record file, its space allocated; returns it, its valid
        records, and -1 when the file was ours (or new), else the number of records it held (it was
        reset). The group's data files are cut to ``num_slots`` (emptied with a reset)."""
        fd = open_file(records_file(self.path, group))
        files = _GroupFiles(fd, group, len(sizes), num_slots, tokens_per_block)
        pools: list[int] = []
        try:
            for p in range(len(sizes)):
                pools.append(open_file(self.pool_path(group, p)))
            header = self._header(group, sizes, tokens_per_block)
            old = os.pread(fd, HEADER_BYTES, 0)
            found: list[DiskRecord] = []
            foreign = -1
            if old == header:
                # a slot beyond a data file's end (a tier resized smaller, a file cut) has no bytes
                readable = num_slots
                for pool, size in zip(pools, sizes):
                    readable = min(readable, os.fstat(pool).st_size // size)
                found = self._read_records(files, readable)
            elif old:
                foreign = _count_foreign(fd, old)
                for pool in pools:  # its bytes mean nothing to us: give the space back
                    os.ftruncate(pool, 0)
            end = HEADER_BYTES + num_slots * files.record
            if old != header:
                os.ftruncate(fd, 0)
                os.pwrite(fd, header, 0)
            os.ftruncate(fd, end)  # records of slots beyond ours are dropped; new ones read as empty
            allocate(fd, 0, end, self.path)  # a disk filling up later cannot refuse a record
            for pool, size in zip(pools, sizes):  # slots beyond ours: reclaimed
                if os.fstat(pool).st_size > num_slots * size:
                    os.ftruncate(pool, num_slots * size)
        except BaseException:
            os.close(fd)
            raise
        finally:
            for pool in pools:
                os.close(pool)
        return files, found, foreign

    def _read_records(self, files: _GroupFiles, num_slots: int) -> list[DiskRecord]:
        """The valid records of slots ``[0, num_slots)``, read in chunks of about 16 MiB."""
        size = files.record
        per = max(1, (16 << 20) // size)
        out: list[DiskRecord] = []
        for first in range(0, num_slots, per):
            data = os.pread(files.fd, min(per, num_slots - first) * size, HEADER_BYTES + first * size)
            if len(data) % size:  # a file cut inside a record: the part is no record
                data = data[: len(data) - len(data) % size]
            self._parse_records(files, data, first, out)
        return out

    @staticmethod
    def _parse_records(files: _GroupFiles, data: bytes, first: int, out: list[DiskRecord]) -> None:
        size = files.record
        t = files.tokens_per_block
        p = files.num_pools
        whole = struct.Struct(f"{RECORD_FORMAT}{4 * p}s{4 * t}s{size - RECORD_HEAD.size - 4 * p - 4 * t - 4}xI")
        view = memoryview(data)
        at = -size
        group = files.group
        for fields in whole.iter_unpack(data):
            at += size
            if fields[0] != RECORD_MAGIC or fields[4] != t:
                continue
            if checksum(view[at : at + size - 4]) != fields[16]:
                continue  # torn or damaged: the slot is free
            flags = fields[1]
            tokens = array("I")
            tokens.frombytes(fields[15])
            record = DiskRecord(
                group,
                first + at // size,
                fields[3],
                fields[2],
                fields[6] if flags & 1 else None,
                fields[7] if flags & 2 else None,
                fields[8],
                fields[9],
                fields[10],
                fields[14],
                tokens,
                (fields[5], fields[11], fields[12], fields[13]),
            )
            out.append(rawref.untrack(record))

    def write(
        self,
        group: int,
        slot: int,
        layer_group: int,
        priority: int,
        scope: tuple[int | None, int | None],
        parent: bytes,
        key: bytes,
        tokens: array[int],
        sums: list[int],
        retention: tuple[int, float, float, int],
    ) -> None:
        """Record that ``slot`` of ``group`` now holds this block's page (its bytes are written and
        ``sums`` are their checksums, one per pool; ``priority`` without retention, ``retention``
        as ``DiskRecord`` keeps it). A failed write is counted, not raised."""
        files = self.files[group]
        if files.fd < 0:
            return  # released (a forked child's copy)
        size = files.record
        buf = bytearray(size)
        lora_id, salt = scope
        flags = (1 if lora_id is not None else 0) | (2 if salt is not None else 0)
        RECORD_HEAD.pack_into(
            buf,
            0,
            RECORD_MAGIC,
            flags,
            priority,
            layer_group,
            len(tokens),
            retention[0],
            lora_id or 0,
            salt or 0,
            self.seq,
            parent,
            key,
            retention[1],
            retention[2],
            retention[3],
        )
        self.seq += 1
        at = RECORD_HEAD.size
        buf[at : at + 4 * len(sums)] = array("I", sums).tobytes()
        at += 4 * files.num_pools
        buf[at : at + 4 * len(tokens)] = tokens.tobytes()
        view = memoryview(buf)
        buf[size - 4 :] = checksum(view[: size - 4]).to_bytes(4, "little")
        try:
            os.pwrite(files.fd, buf, HEADER_BYTES + slot * size)
        except OSError as e:
            self._failed(e)

    def forget(self, group: int, slot: int) -> None:
        """Invalidate the record of ``slot`` of ``group`` (a page that is not persisted now holds
        it: a previous block's record must not be adopted and then fail its checksum)."""
        files = self.files[group]
        if files.fd < 0:
            return
        try:
            os.pwrite(files.fd, bytes(files.record), HEADER_BYTES + slot * files.record)
        except OSError as e:
            self._failed(e)

    def forget_all(self) -> None:
        """Invalidate every record (``clear_reusable_blocks``: nothing is adopted after a restart)."""
        for files in self.files:
            if files.fd < 0:
                continue
            end = HEADER_BYTES + files.num_slots * files.record
            try:
                os.ftruncate(files.fd, HEADER_BYTES)
                os.ftruncate(files.fd, end)
                allocate(files.fd, 0, end, self.path)
            except (OSError, OutOfMemoryError) as e:
                self._failed(e)

    def forget_records(self, records: list[DiskRecord]) -> None:
        """Invalidate ``records`` (their slots are free again)."""
        for r in records:
            self.forget(r.group, r.slot)

    def ignore(self, records: list[DiskRecord]) -> None:
        """Erase ``records``, which adoption ignored (their slots are free again), with one warning:
        the next manager does not meet them again."""
        if not records:
            return
        self.forget_records(records)
        LOG.warning(
            "persistent disk tier %s: ignored %d record(s) that do not fit a tree of blocks (a key that is not "
            "the hash of its parent key and tokens, a parent block missing or looping, a scope's root key, "
            "another scope, layer group or pool group, a second record of one page, a write sequence of 2**63 "
            "or more); their slots are reclaimed",
            self.path,
            len(records),
        )

    def _failed(self, e: BaseException) -> None:
        """A record write failed: counted (the tier's ``io_errors``), the first one logged."""
        self.num_write_errors += 1
        if self.num_write_errors == 1:
            LOG.warning(
                "persistent disk tier %s: a slot record could not be written (%s); blocks whose records "
                "fail are served now but not adopted after a restart (counted in the tier's io_errors)",
                self.path,
                e.strerror if isinstance(e, OSError) and e.strerror else e,
            )

    @property
    def owned(self) -> bool:
        """Whether this process still holds the directory (False once released, and in a forked child)."""
        return self.lock_fd >= 0

    def release(self) -> None:
        """Close the files and give the lock up (idempotent)."""
        _OPEN.pop(id(self), None)
        for files in self.files:
            if files.fd >= 0:
                os.close(files.fd)
                files.fd = -1
        if self.lock_fd >= 0:
            os.close(self.lock_fd)  # the flock goes with the last descriptor of this open file
            self.lock_fd = -1


#: the persistent tiers open in this process (by ``id``): a forked child releases its copies at once
_OPEN: Final[dict[int, PersistentDisk]] = {}


def _release_in_child() -> None:
    """``os.fork`` (``multiprocessing``'s "fork" too) shares the lock's open file with the child, and
    ``flock`` holds while any descriptor of it is open: the child closes its copies (and stops
    writing records), so the directory is free once the parent is gone."""
    for persist in list(_OPEN.values()):
        persist.release()


os.register_at_fork(after_in_child=_release_in_child)


def _take_lock(path: str) -> int:
    """Lock ``path`` for this manager: ``LogicError`` naming the holder when another one has it."""
    name = os.path.join(path, LOCK_NAME)
    fd = open_file(name)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise LogicError(
                f"persistent disk tier {path!r} is in use by another KV-cache manager (process {holder} holds "
                f"{name}); give each manager its own directory"
            ) from None
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _count_foreign(fd: int, header: bytes) -> int:
    """Records a reset file of another layout or version held, where its header can tell."""
    if len(header) < FILE_HEADER.size or header[:8] != FILE_MAGIC:
        return 0
    size = FILE_HEADER.unpack_from(header)[7]
    if size <= 4:
        return 0
    data = os.pread(fd, 64 << 20, HEADER_BYTES)
    return sum(1 for at in range(0, len(data) - size + 1, size) if data[at : at + 4] == RECORD_MAGIC)
