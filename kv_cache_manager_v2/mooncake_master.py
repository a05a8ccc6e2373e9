"""A private Mooncake Store master (``mooncake_master``, with its HTTP metadata server) on free loopback
ports: for tests, benchmarks and the simulator's ``--replicas`` with a ``mooncake://`` tier. Not for
production deployments.

The binary is ``$KVCM_MOONCAKE_MASTER``, else the one the ``mooncake-transfer-engine`` wheel ships (the
``mooncake`` extra), which needs Debian's ``libibverbs1``, ``librdmacm1`` and ``libnuma1``;
``mooncake_unusable_reason`` says why it cannot run here. ``stop``/``kill``/``pause``/``restart``
(inherited from ``LocalRedisServer``) take it away and bring it back on the same ports (empty).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from .redis_server import LocalRedisServer, free_port

ENV_VAR = "KVCM_MOONCAKE_MASTER"


def find_mooncake_master() -> str | None:
    """Path of the ``mooncake_master`` binary, or None."""
    path = os.environ.get(ENV_VAR)
    if path:
        return path if os.access(path, os.X_OK) else None
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    for where in spec.submodule_search_locations:
        binary = os.path.join(where, "mooncake_master")
        if os.access(binary, os.X_OK):
            return binary
    return None


def mooncake_unusable_reason() -> str | None:
    """Why a Mooncake master and client cannot run here (None: they can)."""
    binary = find_mooncake_master()
    if binary is None:
        return "no mooncake_master: pip install 'kv_cache_manager_v2[mooncake]'"
    # (in a child: the client's shared libraries need libibverbs1, librdmacm1 and libnuma1)
    out = subprocess.run(
        [sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True, timeout=60, check=False
    )
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return f"the Mooncake client does not load ({last}): apt-get install libibverbs1 librdmacm1 libnuma1"
    return None


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class LocalMooncakeMaster(LocalRedisServer):
    """One ``mooncake_master`` child process on 127.0.0.1 (RPC and HTTP metadata ports); a context manager."""

    def __init__(self, binary: str | None = None, extra_args: Sequence[str] = ()) -> None:
        found = binary or find_mooncake_master()
        if found is None:
            raise FileNotFoundError(f"no mooncake_master binary: {mooncake_unusable_reason()}")
        super().__init__(found, free_port(), extra_args)
        self.metadata_port = free_port()
        self.metrics_port = free_port()

    @property
    def url(self) -> str:
        return self.url_with()

    def url_with(self, segment: int = 64 << 20) -> str:
        """The ``mooncake://`` URL of this master, a client contributing ``segment`` bytes."""
        return (
            f"mooncake://127.0.0.1:{self.port}?metadata=http://127.0.0.1:{self.metadata_port}/metadata"
            f"&protocol=tcp&segment={segment}&hostname=127.0.0.1"
        )

    def start(self, timeout_s: float = 20.0) -> None:
        """Start it (again: on the same ports, empty) and wait until both ports accept."""
        if self.proc is not None and self.proc.poll() is None:
            return
        cmd = [
            self.binary,
            f"--rpc_port={self.port}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.metadata_port}",
            f"--metrics_port={self.metrics_port}",
            *self.extra_args,
        ]
        log = os.path.join(self._dir, "master.log")
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not (_accepts(self.port) and _accepts(self.metadata_port)):
            if self.proc.poll() is not None:
                with open(log, "rb") as f:
                    err = f.read().decode(errors="replace")
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}: {err.strip()[-500:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"mooncake_master on port {self.port} did not answer within {timeout_s} s")
            time.sleep(0.01)

    def __enter__(self) -> LocalMooncakeMaster:
        self.start()
        return self
