"""The persistent disk tier's files (``DiskCacheTierConfig(persistent=True)``): a lock, per pool group
one data file per pool and one file of slot records, so a new manager with the same layout adopts
the published blocks a previous one left there.

Files in the tier's directory:

- ``kvcm-disk.lock``: ``flock``-ed by the manager using the directory; a second opener is refused.
- ``kvcm-g<group>-p<pool>.pool``: the slots' bytes (as in a private disk pool).
- ``kvcm-g<group>.slots``: a 4 KiB header (magic, format version, checksum algorithm, pool group,
  layout fingerprint, namespace digest, slot sizes digest, record size, tokens per block), then one
  fixed-size record per slot: magic, scope (LoRA id, salt), layer group, priority, write sequence,
  parent and block keys, the checksum of the slot's bytes in each pool, the block's token ids, and
  the record's own checksum.

Crash safety needs no ``fsync`` ordering: a slot's bytes are written before its record, a record
is valid only when its own checksum matches, and a slot is served only when its bytes match the
checksum its record names (verified at every read). A process killed anywhere leaves each slot
old-and-valid or unusable (a miss), never torn-and-served. A file of another layout, format version,
checksum algorithm or namespace is ignored (one warning) and overwritten.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import hashlib
import logging
import os
import struct
from array import array
from typing import Final

import rawref

from .._config import DiskCacheTierConfig
from .._exceptions import LogicError
from ._disk import CHECKSUM_IDS, CHECKSUM_NAME, checksum

LOG = logging.getLogger("kv_cache_manager_v2")

LOCK_NAME: Final = "kvcm-disk.lock"
FILE_MAGIC: Final = b"KVCMDSK\x00"
#: bump when the record or file layout changes
DISK_FORMAT_VERSION: Final = 1
#: magic, format version, checksum algorithm, pool group, layout fingerprint, namespace digest,
#: slot sizes digest, record size, tokens per block
FILE_HEADER: Final = struct.Struct("<8sHHI8s8s8sII")
#: records start here (one page: a record never shares a page with the header)
HEADER_BYTES: Final = 4096
RECORD_MAGIC: Final = b"KVR1"
#: magic, flags (1: LoRA id, 2: salt), priority, layer group, tokens, reserved, LoRA id, salt,
#: sequence, parent key, block key; then one checksum per pool, the token ids, the record checksum
RECORD_HEAD: Final = struct.Struct("<4sBBHHHQQQ32s32s")


def pool_file(path: str, group: int, pool: int) -> str:
    """The data file of ``pool`` of pool group ``group`` in a persistent tier's directory."""
    return os.path.join(path, f"kvcm-g{group}-p{pool}.pool")


def record_size(num_pools: int, tokens_per_block: int) -> int:
    """Bytes of one slot record (a multiple of 16)."""
    n = RECORD_HEAD.size + 4 * num_pools + 4 * tokens_per_block + 4
    return (n + 15) // 16 * 16


class DiskRecord:
    """One valid slot record read back: which published block's page the slot holds (``sums``: the
    checksum of each pool's bytes, 4 bytes little-endian each). Untracked by the cyclic GC (it holds
    no container), so adopting millions of them triggers no full collections."""

    __slots__ = (
        "group",
        "key",
        "layer_group",
        "lora_id",
        "parent",
        "priority",
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
    takes the lock (``LogicError`` if another manager holds it), reads every compatible record
    file (``records[g]``: the valid records of slots below the slot count) and resets the others;
    the data files are then opened by the disk pools (``pool_path``).
    """

    def __init__(
        self,
        cfg: DiskCacheTierConfig,
        fingerprint: bytes,
        groups: list[tuple[tuple[int, ...], int]],
        tokens_per_block: int,
    ) -> None:
        self.path = cfg.path
        self.lock_fd = _take_lock(cfg.path)
        self.files: list[_GroupFiles] = []
        #: per pool group, the valid records loaded at start-up (emptied once adopted)
        self.records: list[list[DiskRecord]] = []
        #: write sequence of the next record (orders adopted pages oldest first)
        self.seq = 1
        #: record writes that failed (the slot is then just not persisted)
        self.num_write_errors = 0
        self._namespace = hashlib.sha256(cfg.namespace.encode()).digest()[:8]
        self._fingerprint = fingerprint
        ignored_files = ignored_records = 0
        try:
            for g, (sizes, num_slots) in enumerate(groups):
                files, found, foreign = self._open_group(g, sizes, num_slots, tokens_per_block)
                self.files.append(files)
                self.records.append(found)
                if foreign >= 0:
                    ignored_files += 1
                    ignored_records += foreign
            for name in glob.glob(os.path.join(cfg.path, "kvcm-g*")):  # groups or pools this layout lacks
                if not self._is_ours(os.path.basename(name), groups):
                    os.unlink(name)
                    ignored_files += 1
        except BaseException:
            self.release()
            raise
        for found in self.records:
            for r in found:
                if r.seq >= self.seq:
                    self.seq = r.seq + 1
        if ignored_files:
            LOG.warning(
                "persistent disk tier %s: ignored %d file(s) (%d record(s)) written with another layout, format "
                "version, checksum or namespace; their space is reclaimed",
                cfg.path,
                ignored_files,
                ignored_records,
            )

    @staticmethod
    def _is_ours(name: str, groups: list[tuple[tuple[int, ...], int]]) -> bool:
        for g, (sizes, _) in enumerate(groups):
            if name == f"kvcm-g{g}.slots" or any(name == f"kvcm-g{g}-p{p}.pool" for p in range(len(sizes))):
                return True
        return False

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
        """Open (or create) group ``group``'s record file; returns it, its valid records, and -1 when the
        file was ours (or new), else the number of records it held (it was reset)."""
        name = os.path.join(self.path, f"kvcm-g{group}.slots")
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        files = _GroupFiles(fd, group, len(sizes), num_slots, tokens_per_block)
        try:
            header = self._header(group, sizes, tokens_per_block)
            old = os.pread(fd, HEADER_BYTES, 0)
            found: list[DiskRecord] = []
            foreign = -1
            if old == header:
                # a slot beyond a data file's end (a tier resized smaller, a file cut) has no bytes
                readable = num_slots
                for p, size in enumerate(sizes):
                    path = self.pool_path(group, p)
                    readable = min(readable, os.path.getsize(path) // size if os.path.exists(path) else 0)
                found = self._read_records(files, readable)
            elif old:
                foreign = _count_foreign(fd, old)
                for p in range(len(sizes)):  # its bytes mean nothing to us: give the space back
                    path = self.pool_path(group, p)
                    if os.path.exists(path):
                        os.truncate(path, 0)
            end = HEADER_BYTES + num_slots * files.record
            if old != header:
                os.ftruncate(fd, 0)
                os.pwrite(fd, header, 0)
            os.ftruncate(fd, end)  # records of slots beyond ours are dropped; new ones read as empty
            for p, size in enumerate(sizes):  # slots beyond ours: reclaimed
                path = self.pool_path(group, p)
                if os.path.exists(path) and os.path.getsize(path) > num_slots * size:
                    os.truncate(path, num_slots * size)
        except BaseException:
            os.close(fd)
            raise
        return files, found, foreign

    def _read_records(self, files: _GroupFiles, num_slots: int) -> list[DiskRecord]:
        """The valid records of slots ``[0, num_slots)``, read in chunks of about 16 MiB."""
        size = files.record
        per = max(1, (16 << 20) // size)
        out: list[DiskRecord] = []
        for first in range(0, num_slots, per):
            data = os.pread(files.fd, min(per, num_slots - first) * size, HEADER_BYTES + first * size)
            self._parse_records(files, data, first, out)
        return out

    @staticmethod
    def _parse_records(files: _GroupFiles, data: bytes, first: int, out: list[DiskRecord]) -> None:
        size = files.record
        t = files.tokens_per_block
        p = files.num_pools
        whole = struct.Struct(f"<4sBBHHHQQQ32s32s{4 * p}s{4 * t}s{size - RECORD_HEAD.size - 4 * p - 4 * t - 4}xI")
        view = memoryview(data)
        at = -size
        group = files.group
        for fields in whole.iter_unpack(data):
            at += size
            if fields[0] != RECORD_MAGIC or fields[4] != t:
                continue
            if checksum(view[at : at + size - 4]) != fields[13]:
                continue  # torn or damaged: the slot is free
            flags = fields[1]
            tokens = array("I")
            tokens.frombytes(fields[12])
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
                fields[11],
                tokens,
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
    ) -> None:
        """Record that ``slot`` of ``group`` now holds this block's page (its bytes are written and
        ``sums`` are their checksums, one per pool). A failed write is counted, not raised."""
        files = self.files[group]
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
            0,
            lora_id or 0,
            salt or 0,
            self.seq,
            parent,
            key,
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
        except OSError:
            self.num_write_errors += 1

    def forget(self, group: int, slot: int) -> None:
        """Invalidate the record of ``slot`` of ``group`` (a page that is not persisted now holds
        it: a previous block's record must not be adopted and then fail its checksum)."""
        files = self.files[group]
        try:
            os.pwrite(files.fd, bytes(files.record), HEADER_BYTES + slot * files.record)
        except OSError:
            self.num_write_errors += 1

    def forget_all(self) -> None:
        """Invalidate every record (``clear_reusable_blocks``: nothing is adopted after a restart)."""
        for files in self.files:
            end = HEADER_BYTES + files.num_slots * files.record
            try:
                os.ftruncate(files.fd, HEADER_BYTES)
                os.ftruncate(files.fd, end)
            except OSError:
                self.num_write_errors += 1

    def release(self) -> None:
        """Close the files and give the lock up (idempotent)."""
        for files in self.files:
            if files.fd >= 0:
                os.close(files.fd)
                files.fd = -1
        if self.lock_fd >= 0:
            os.close(self.lock_fd)  # releases the flock
            self.lock_fd = -1


def _take_lock(path: str) -> int:
    """Lock ``path`` for this manager: ``LogicError`` naming the holder when another one has it."""
    name = os.path.join(path, LOCK_NAME)
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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
