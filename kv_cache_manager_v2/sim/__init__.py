"""The trace-driven serving simulator (``kv-cache-sim``; ``python -m kv_cache_manager_v2.sim``).

Replays a Mooncake-format trace or built-in multi-turn conversations through the real manager
(via the engine adapter) for a model shape and tier quotas, and reports prefix hit rates,
memory, preemptions, what users wait for (queueing, TTFT, TPOT, end to end: a roofline step time
and tier I/O), throughput, goodput and the manager's CPU time. Programmatic use::

    from kv_cache_manager_v2.sim import main
    main(["--model", "llama-3-8b", "--gpu", "16GiB", "--json", "report.json"])
"""

from __future__ import annotations

from ._cli import main
from ._models import PRESETS, ModelShape, SimUserError, TierSpec, model_shape, parse_quota
from ._replay_types import SchedulerOptions
from ._run import simulate
from ._workload import ConversationParams, SimRequest, generate_conversations, load_trace

__all__ = [
    "PRESETS",
    "ConversationParams",
    "ModelShape",
    "SchedulerOptions",
    "SimRequest",
    "SimUserError",
    "TierSpec",
    "generate_conversations",
    "load_trace",
    "main",
    "model_shape",
    "parse_quota",
    "simulate",
]
