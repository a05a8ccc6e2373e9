"""The time pages take between the GPU and a lower tier: one link per tier (host, disk, remote), with
a bandwidth each way and a latency.

What the manager does today, step by step: it onboards pages synchronously in ``prepare_resources``
(one batch per source level, one after the other), so a step that onboards pages starts its compute
only once their bytes crossed the links (the requests that needed them get their prefill after their
loads: the whole step waits). Offloads (evictions to a lower tier, write-through to a remote one)
run in the background, as an asynchronous copy engine runs them, but occupy their link: each link
has a busy-until time, and a step's loads wait behind the offloads queued before it on the same link
(this step's own offloads queue after its loads). The queue is bounded: a step whose offloads leave
more than ``WRITE_BACKLOG_MS`` of writes queued on a link ends only once the backlog is back within
it (a copy engine's queue is finite: a link slower than the writes it is given slows the engine
down, it does not fall behind for ever). The manager's write admission sees the same links (its
tiers' write costs priced from them, ``priced_tiers``; their backlogs told each step,
``_loading.tell_link_waits``): it declines the evicted reusable pages a link cannot absorb within
``max_write_backlog_s`` (by default the same 1 s), so only pages requests still own stall a step
for writes. Today's manager copies offloads synchronously, so where writes matter this model is
its lower bound. A transfer costs the link's latency once per step and direction, plus its bytes at the
link's bandwidth; bytes are those of the real model (the replay's proxy bytes times the scale of
``_models.real_bytes_per_proxy_byte``). A load from the disk or remote tier is charged to that
tier's link alone (its slowest part; the host link it may cross too is not charged).

Defaults (``--tier-bandwidth``/``--tier-latency`` override them), with their sources:

- host: the GPU's host link (``--gpu-kind``'s ``GpuSpec.host_link_bytes_per_s``) at the share
  pinned-memory copies achieve, ``HOST_LINK_SHARE``: PCIe Gen5 x16 is 64 GB/s a direction in theory,
  ~50-55 GB/s achieved on an H100 (NVIDIA's bandwidthTest / nvbandwidth figures), so 50 GB/s each
  way there (25 GB/s on a PCIe Gen4 A100 or L40S); 10 us a transfer (a copy's launch and DMA set-up).
- disk: a data-centre PCIe Gen4 x4 NVMe SSD: sequential read ~6.5-7 GB/s, write ~3.5-4.5 GB/s
  (vendors' datasheets, e.g. Samsung PM9A3, Kioxia CM6); 6.5 GB/s read, 3.5 GB/s write, 100 us a
  transfer (a random read's latency, ~80-100 us).
- remote: a 25 Gb/s data-centre network (3.125 GB/s line rate; a Redis connection rarely does
  better), 0.5 ms a transfer (a TCP round trip within a data centre plus the server's command).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from .._common import TierStatistics
from .._config import CacheTierConfig, DiskCacheTierConfig, HostCacheTierConfig, RemoteCacheTierConfig
from ._models import SimUserError, is_zero_quota

#: the tiers below the GPU that have a link, in level order
LINK_TIERS = ("host", "disk", "remote")
#: the share of a GPU's host link (its line rate) that pinned-memory copies achieve (50 of 64 GB/s)
HOST_LINK_SHARE = 50 / 64
#: link time of offloads a link may have queued when a step ends (beyond it the step waits)
WRITE_BACKLOG_MS = 1000.0
#: the fastest read a tier's config is given (a free link, ``inf``, is priced at this)
MAX_BYTES_PER_S = 1e30


@dataclass(frozen=True)
class Link:
    """A tier's link to the GPU: bytes per second each way (reads: onboarding; writes: offloading),
    and a latency per transfer; ``math.inf`` bandwidth with 0 latency is free."""

    read_bytes_per_s: float
    write_bytes_per_s: float
    latency_ms: float


@dataclass(frozen=True)
class TierLinks:
    """The links of the host, disk and remote tiers (see the module doc for the defaults)."""

    host: Link = Link(50e9, 50e9, 0.01)
    disk: Link = Link(6.5e9, 3.5e9, 0.1)
    remote: Link = Link(3.125e9, 3.125e9, 0.5)

    def of(self, tier: str) -> Link:
        return self.host if tier == "host" else self.disk if tier == "disk" else self.remote


#: free links (no time): what a replay without tier I/O assumes
FREE = Link(math.inf, math.inf, 0.0)

_BANDWIDTH_RE = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kKMGT]?)(i?)([Bb])(?:/s|ps)$")
_LATENCY_RE = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(s|ms|us|µs|ns)$")
_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_BINARY = {"": 1.0, "k": 1024.0, "K": 1024.0, "M": 1024.0**2, "G": 1024.0**3, "T": 1024.0**4}
_SECONDS_MS = {"s": 1000.0, "ms": 1.0, "us": 1e-3, "µs": 1e-3, "ns": 1e-6}


def parse_bandwidth(option: str, text: str) -> float:
    """Bytes per second from ``50GB/s``, ``200MB/s``, ``1.5GiB/s``, ``25Gb/s`` (bits) or ``inf``."""
    t = text.strip()
    if t.lower() == "inf":
        return math.inf
    m = _BANDWIDTH_RE.match(t)
    if m is None:
        raise SimUserError(
            f"{option}: {text!r} is not a bandwidth; write e.g. 50GB/s, 200MB/s, 1.5GiB/s, 25Gb/s (bits) or inf"
        )
    value = float(m.group(1)) * (_BINARY if m.group(3) else _PREFIX)[m.group(2)] / (8.0 if m.group(4) == "b" else 1.0)
    if value <= 0:
        raise SimUserError(f"{option}: {text!r}: a bandwidth must be > 0 (inf: free)")
    return value


def parse_latency(option: str, text: str) -> float:
    """Milliseconds from ``0.5ms``, ``100us``, ``1s``, ``0``."""
    t = text.strip()
    if t in ("0", "0.0"):
        return 0.0
    m = _LATENCY_RE.match(t)
    if m is None:
        raise SimUserError(f"{option}: {text!r} is not a latency; write e.g. 0.5ms, 100us, 1s or 0")
    value = float(m.group(1)) * _SECONDS_MS[m.group(2)]
    if not value < 3_600_000.0:
        raise SimUserError(f"{option}: {text!r}: a latency must be under an hour")
    return value


def _items(option: str, text: str | None, configured: tuple[str, ...], sides: bool) -> list[tuple[str, str, str]]:
    """``TIER=VALUE`` items of ``text``: (tier, side: read/write/"" both, value)."""
    out: list[tuple[str, str, str]] = []
    seen: set[str] = set()
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        tier, _, side = key.partition("-")
        keys = ", ".join(f"{x}{'[-read|-write]' if sides else ''}" for x in LINK_TIERS)
        if not sep or tier not in LINK_TIERS or side not in (("", "read", "write") if sides else ("",)):
            raise SimUserError(f"{option} {item.strip()!r}: write TIER=VALUE,... with TIER one of {keys}")
        if tier not in configured:
            have = ", ".join(configured) or "none"
            raise SimUserError(
                f"{option} {tier}: this run has no {tier} tier (its tiers below the GPU: {have}); drop {tier}"
            )
        if key in seen:
            raise SimUserError(f"{option}: {key} given twice")
        seen.add(key)
        out.append((tier, side, value))
    return out


def tier_links(
    bandwidth: str | None, latency: str | None, configured: tuple[str, ...], host_link_bytes_per_s: float = 64e9
) -> TierLinks:
    """The default links (the host's: ``host_link_bytes_per_s``, the GPU's line rate, at
    ``HOST_LINK_SHARE``) with ``--tier-bandwidth``/``--tier-latency`` applied; a tier must be one of
    ``configured`` (the run's tiers below the GPU); raises SimUserError on bad input."""
    d = TierLinks()
    host = host_link_bytes_per_s * HOST_LINK_SHARE
    links = {x: d.of(x) for x in LINK_TIERS}
    links["host"] = Link(host, host, d.host.latency_ms)
    for tier, side, value in _items("--tier-bandwidth", bandwidth, configured, True):
        bw = parse_bandwidth(f"--tier-bandwidth {tier}", value)
        old = links[tier]
        read = bw if side in ("", "read") else old.read_bytes_per_s
        write = bw if side in ("", "write") else old.write_bytes_per_s
        links[tier] = Link(read, write, old.latency_ms)
    for tier, _, value in _items("--tier-latency", latency, configured, False):
        old = links[tier]
        links[tier] = Link(old.read_bytes_per_s, old.write_bytes_per_s, parse_latency(f"--tier-latency {tier}", value))
    return TierLinks(links["host"], links["disk"], links["remote"])


class TierIO:
    """The links of a replay's levels (level 0, the GPU, has none) and when each is busy until."""

    def __init__(self, tiers: list[str], links: TierLinks, bytes_scale: float) -> None:
        #: per level (``tiers``: its kind, "gpu" first): ms per proxy byte read and written, latency
        self.read_ms: list[float] = []
        self.write_ms: list[float] = []
        self.latency_ms: list[float] = []
        for kind in tiers:
            link = FREE if kind not in LINK_TIERS else links.of(kind)
            self.read_ms.append(bytes_scale * 1000.0 / link.read_bytes_per_s)
            self.write_ms.append(bytes_scale * 1000.0 / link.write_bytes_per_s)
            self.latency_ms.append(link.latency_ms)
        self.busy_until = [0.0] * len(tiers)
        #: per level: a request loading from it waits apart from the steps (disk, remote: the
        #: adapter's loading state); host copies are ordered within the step (the step waits)
        self.apart = [kind in ("disk", "remote") for kind in tiers]
        self.load_ms = 0.0  #: the time steps waited for loads (summed)
        self.background_ms = 0.0  #: the time requests waited for their own loads (``load``, summed)
        self.write_stall_ms = 0.0  #: the time steps waited for write backlogs beyond WRITE_BACKLOG_MS

    def step(self, start_ms: float, traffic: list[TierStatistics]) -> float:
        """A step starting at ``start_ms`` with ``traffic`` (``take_iteration_stats``, proxy bytes):
        queue its loads (level after level) then its offloads; returns when its loads are done and
        its links' write backlogs are within ``WRITE_BACKLOG_MS``."""
        loaded = self._queue_loads(start_ms, traffic)
        t = loaded
        written = self._queue_offloads(start_ms, traffic)
        if written - WRITE_BACKLOG_MS > t:
            t = written - WRITE_BACKLOG_MS
        self.load_ms += loaded - start_ms
        self.write_stall_ms += t - loaded
        return t

    def load(self, start_ms: float, traffic: list[TierStatistics], in_step: bool = False) -> float:
        """One request's traffic at its admission under background loads (``--load-policy``): its
        loads queue on their links from ``start_ms`` (level after level), then its offloads;
        returns when its loads are done: the request waits for them, the step does not (with
        ``in_step``, host copies ordered within the step: the step waits for them)."""
        t = self._queue_loads(start_ms, traffic)
        self._queue_offloads(start_ms, traffic)
        if in_step:
            self.load_ms += t - start_ms
        else:
            self.background_ms += t - start_ms
        return t

    def waits_apart(self, traffic: list[TierStatistics]) -> bool:
        """Whether ``traffic`` (one request's, at its admission) loads from a level read apart
        from the steps (``apart``)."""
        return any(it.onboarded_bytes > 0 and self.apart[it.level] for it in traffic)

    def _queue_loads(self, start_ms: float, traffic: list[TierStatistics]) -> float:
        """Queue ``traffic``'s loads on their links from ``start_ms``, level after level; returns
        when the last is done (``start_ms`` without any)."""
        t = start_ms
        for it in traffic:
            lvl = it.level
            nbytes = it.onboarded_bytes
            if nbytes:
                busy = self.busy_until[lvl]
                t = (busy if busy > t else t) + self.latency_ms[lvl] + nbytes * self.read_ms[lvl]
                self.busy_until[lvl] = t
        return t

    def _queue_offloads(self, start_ms: float, traffic: list[TierStatistics]) -> float:
        """Queue ``traffic``'s offloads on their links from ``start_ms``; returns when the last
        ends (``start_ms`` without any)."""
        last = start_ms
        for it in traffic:
            lvl = it.level
            nbytes = it.offloaded_bytes
            if nbytes:
                busy = self.busy_until[lvl]
                end = (busy if busy > start_ms else start_ms) + self.latency_ms[lvl] + nbytes * self.write_ms[lvl]
                self.busy_until[lvl] = end
                if end > last:
                    last = end
        return last


def priced_tiers(tiers: Sequence[CacheTierConfig], links: TierLinks, bytes_scale: float) -> list[CacheTierConfig]:
    """``tiers`` with the read and write costs of each tier below the GPU set from its link (the
    manager's ``load_policy="auto"`` prices loads, and its write admission queued writes, as the
    replay times them): the link's bandwidth each way in proxy bytes (``bytes_scale``: real bytes
    per proxy byte) and its latency."""
    out: list[CacheTierConfig] = []
    for tier in tiers:
        if isinstance(tier, (HostCacheTierConfig, DiskCacheTierConfig, RemoteCacheTierConfig)):
            link = links.of(tier_kind(tier))
            bw = link.read_bytes_per_s / bytes_scale
            cost: dict[str, Any] = {
                "read_bytes_per_s": min(bw, MAX_BYTES_PER_S),
                "read_latency_s": link.latency_ms / 1e3,
            }
            if not isinstance(tier, RemoteCacheTierConfig):  # (the remote writer has its own queue)
                cost["write_bytes_per_s"] = min(link.write_bytes_per_s / bytes_scale, MAX_BYTES_PER_S)
            tier = replace(tier, **cost)
        out.append(tier)
    return out


def add_arguments(g: Any) -> None:
    """The time options of ``kv-cache-sim`` (an argparse group): tier I/O, the manager's time, the
    per-request file."""
    d = TierLinks()
    g.add_argument(
        "--tier-bandwidth",
        metavar="TIER=BW,..",
        help="bandwidth of a tier's link to the GPU, both ways (TIER-read/TIER-write: one way), e.g. "
        f"disk=200MB/s,host=50GB/s (25Gb/s: bits; inf: free) (default: host {_gb(d.host.read_bytes_per_s)} (H100's "
        f"PCIe Gen5 x16; scaled by --gpu-kind), disk read {_gb(d.disk.read_bytes_per_s)} write {_gb(d.disk.write_bytes_per_s)} (data-centre "
        f"NVMe), remote {_gb(d.remote.read_bytes_per_s)} (25 Gb/s network))",
    )
    g.add_argument(
        "--tier-latency",
        metavar="TIER=TIME,..",
        help="latency of a transfer on a tier's link, e.g. remote=0.5ms,disk=0.1ms (default: host "
        f"{d.host.latency_ms * 1000:g}us, disk {d.disk.latency_ms * 1000:g}us, remote {d.remote.latency_ms:g}ms)",
    )
    g.add_argument(
        "--no-tier-io", action="store_true", help="pages move between tiers in no time (a hit costs nothing)"
    )
    g.add_argument(
        "--count-manager-time",
        action="store_true",
        help="add the manager's measured CPU time of each step to the step's time (runs are then not repeatable)",
    )
    g.add_argument(
        "--per-request",
        metavar="FILE",
        help="write one JSON line per request: arrival, queueing delay, TTFT, TPOT, end to end (ms), tokens "
        "reused by tier, loaded, recomputed; rejected requests marked",
    )


def time_options(
    a: Any, uses_disk: bool, sweep: tuple[str, list[str]] | None, host_link_bytes_per_s: float
) -> TierLinks | None:
    """The checked time options of ``kv-cache-sim``'s namespace ``a``: the links (None:
    ``--no-tier-io``) of the tiers below the GPU the run has (``uses_disk``: a disk tier or a disk
    sweep; ``sweep``: key, values; ``host_link_bytes_per_s``: the GPU's host link)."""
    if a.per_request and (a.replicas != 1 or a.remote_url or a.restart_at is not None):
        raise SimUserError("--per-request writes the requests of one replay (or sweep): no --replicas or --restart-at")
    if a.no_tier_io:
        if a.tier_bandwidth or a.tier_latency:
            raise SimUserError("--no-tier-io: pages move in no time; drop --tier-bandwidth/--tier-latency")
        return None
    below = {"host": bool(a.host), "disk": uses_disk, "remote": a.replicas != 1 or bool(a.remote_url)}
    if sweep is not None and sweep[0] == "host":
        below["host"] = not all(map(is_zero_quota, sweep[1]))
    configured = tuple(k for k in LINK_TIERS if below[k])
    return tier_links(a.tier_bandwidth, a.tier_latency, configured, host_link_bytes_per_s)


def _gb(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:g}GB/s"


def link_report(
    links: TierLinks | None, tiers: list[str], load_wait_ms: float, write_stall_ms: float = 0.0
) -> dict[str, Any]:
    """The links of ``tiers`` (their kinds below the GPU) and the time steps waited for loads and for
    write backlogs, JSON-ready."""
    if links is None:
        return {"enabled": False}
    out: dict[str, Any] = {
        "enabled": True,
        "load_wait_s": load_wait_ms / 1000.0,
        "write_stall_s": write_stall_ms / 1000.0,
        "write_backlog_limit_s": WRITE_BACKLOG_MS / 1000.0,
    }
    for kind in tiers:
        if kind in LINK_TIERS:
            link = links.of(kind)
            out[kind] = {  # (None: free)
                "read_bytes_per_s": link.read_bytes_per_s if link.read_bytes_per_s < math.inf else None,
                "write_bytes_per_s": link.write_bytes_per_s if link.write_bytes_per_s < math.inf else None,
                "latency_ms": link.latency_ms,
            }
    return out


def link_rows(section: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) rows of the text report for its ``tier_io`` section (none without a lower tier)."""
    if not section["enabled"]:
        return [("tier I/O", "off (--no-tier-io: pages move between tiers in no time)")]
    links = []
    for kind in LINK_TIERS:
        link = section.get(kind)
        if link is not None:
            read, write = (
                x / 1e9 if x is not None else math.inf for x in (link["read_bytes_per_s"], link["write_bytes_per_s"])
            )
            bw = f"{read:g} GB/s" if read == write else f"{read:g}/{write:g} GB/s read/write"
            links.append(f"{kind} {bw}, {link['latency_ms'] * 1000:g} us")
    if not links:
        return []
    waited = (
        f"steps waited {section['load_wait_s']:,.1f} s for loads, {section['write_stall_s']:,.1f} s for queued writes"
    )
    return [("tier I/O", f"{'; '.join(links)}: {waited}")]


def tier_kind(tier: object) -> str:
    """A cache tier's link (``_tier_io.LINK_TIERS``), "gpu" for the GPU tier."""
    if isinstance(tier, HostCacheTierConfig):
        return "host"
    if isinstance(tier, DiskCacheTierConfig):
        return "disk"
    return "remote" if isinstance(tier, RemoteCacheTierConfig) else "gpu"
