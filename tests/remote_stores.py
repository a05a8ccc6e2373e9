"""The remote stores the backend-independent remote-tier tests run on, started for real on loopback:
one redis-server, a 3-master Redis Cluster, a Mooncake Store master. Each is a ``StoreUnderTest``: its
URL, and what a test does to the store itself (take it away, bring it back empty, hang it)."""

from __future__ import annotations

import os
import time

from kv_cache_manager_v2.mooncake_master import LocalMooncakeMaster, mooncake_unusable_reason
from kv_cache_manager_v2.redis_server import LocalRedisCluster, LocalRedisServer, command

# the Mooncake client logs every connection at INFO on stderr (glog): warnings and errors only
os.environ.setdefault("GLOG_minloglevel", "1")

#: why Mooncake tests are skipped here (None: they run); checked once per process
MOONCAKE_REASON = mooncake_unusable_reason()


class StoreUnderTest:
    """One store started for a test (or a module of tests)."""

    name = ""

    @property
    def url(self) -> str:
        raise NotImplementedError

    def kill(self) -> None:
        """A crash: every value is gone, calls fail."""
        raise NotImplementedError

    def start(self) -> None:
        """Back after ``kill``, empty, at the same address."""
        raise NotImplementedError

    def pause(self) -> None:
        """Hung: connections stay, nothing answers."""
        raise NotImplementedError

    def resume(self) -> None:
        raise NotImplementedError

    def ready(self) -> None:
        """Serving (a test that failed midway may have left it down or hung)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class RedisStore(StoreUnderTest):
    name = "redis"

    def __init__(self, binary: str) -> None:
        self.server = LocalRedisServer(binary)
        self.server.start()

    @property
    def url(self) -> str:
        return self.server.url

    def kill(self) -> None:
        self.server.kill()

    def start(self) -> None:
        self.server.start()

    def pause(self) -> None:
        self.server.pause()

    def resume(self) -> None:
        self.server.resume()

    def ready(self) -> None:
        self.server.resume()
        self.server.start()

    def close(self) -> None:
        self.server.close()


class ClusterStore(StoreUnderTest):
    name = "cluster"

    def __init__(self, binary: str) -> None:
        self.cluster = LocalRedisCluster(3, binary)
        self.cluster.start()

    @property
    def url(self) -> str:
        return self.cluster.url

    def kill(self) -> None:
        for s in self.cluster.servers:
            s.kill()

    def start(self) -> None:
        for s in self.cluster.servers:
            s.start()
        self.cluster.wait_ready()
        for p in self.cluster.ports:  # (a node restarts with its cluster config, and its data gone)
            command(p, "FLUSHALL")

    def pause(self) -> None:
        for s in self.cluster.servers:
            s.pause()

    def resume(self) -> None:
        for s in self.cluster.servers:
            s.resume()

    def ready(self) -> None:
        for s in self.cluster.servers:
            s.resume()
            if s.proc is None:
                s.start()
        self.cluster.wait_ready()

    def close(self) -> None:
        self.cluster.close()


class MooncakeStore(StoreUnderTest):
    name = "mooncake"

    def __init__(self) -> None:
        self.master = LocalMooncakeMaster()
        self.master.start()

    @property
    def url(self) -> str:
        return self.master.url_with(32 << 20)

    def kill(self) -> None:
        self.master.kill()

    def start(self) -> None:
        self.master.start()
        time.sleep(0.05)

    def pause(self) -> None:
        self.master.pause()

    def resume(self) -> None:
        self.master.resume()

    def ready(self) -> None:
        self.master.resume()
        self.master.start()

    def close(self) -> None:
        self.master.close()
