"""Two replicas publish KV-cache events over ZMQ (loopback); a KV-aware router routes by them.

.venv/bin/python examples/kv_events_router.py      (needs the events extra: msgspec, pyzmq)
"""

from __future__ import annotations

import random

import kv_cache_manager_v2 as kvm
from kv_cache_manager_v2.events import KVAwareRouter, ReplicaEndpoints, ZmqEventPublisher

T = 16


def make_replica() -> tuple[kvm.KVCacheManager, ZmqEventPublisher]:
    layers = [
        kvm.AttentionLayerConfig(kvm.LayerId(i), [kvm.BufferConfig("key", 1024), kvm.BufferConfig("value", 1024)])
        for i in range(4)
    ]
    config = kvm.KVCacheManagerConfig(T, [kvm.GpuCacheTierConfig(64 << 20)], layers, backend="host")
    manager = kvm.KVCacheManager(config, event_manager=kvm.KVCacheEventManager())
    return manager, ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv")


def serve(manager: kvm.KVCacheManager, prompt: list[int]) -> int:
    """Prefill a prompt (the KV computation itself is elided) and finish the request."""
    kv = manager.create_kv_cache(input_tokens=prompt)
    reused = kv.history_length
    assert kv.resume() and kv.resize(len(prompt))
    kv.commit(prompt[reused:])
    kv.close()
    return reused


def main() -> None:
    replicas = [make_replica() for _ in range(2)]
    router = KVAwareRouter([ReplicaEndpoints(p.endpoint, p.replay_endpoint) for _, p in replicas], topic="kv")
    rng = random.Random(0)
    documents = [[rng.randrange(50_000) for _ in range(200)] for _ in range(4)]
    reused_total = 0
    for turn in range(12):
        doc = documents[turn % 4]
        prompt = doc + [rng.randrange(50_000) for _ in range(20)]  # a question about the document
        decision = router.route(prompt)
        manager, publisher = replicas[decision.replica]
        reused = serve(manager, prompt)
        reused_total += reused
        assert reused == decision.matched_tokens  # the router knew what the replica would reuse
        print(
            f"turn {turn:2d}: document {turn % 4} -> replica {decision.replica} (scores {decision.scores}), reused {reused}"
        )
        publisher.publish(manager.get_latest_events())  # once per engine step
        last = publisher.flush()
        while router.last_seq(decision.replica) < last:
            router.poll(0.05)
            if router.last_seq(decision.replica) < last:
                router.catch_up(decision.replica)  # a fresh subscription misses the first messages
    print(f"reused {reused_total} prompt tokens in total")
    router.close()
    for _, publisher in replicas:
        publisher.close()


if __name__ == "__main__":
    main()
