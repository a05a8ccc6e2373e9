"""Where hybrid models keep recurrent-state snapshots (``ssm_snapshot_policy``, issue 36): branch
points planned at admission from the match, the prompt's last full block, demand promotion, the
interval snapshots of "auto" on a lower tier; statistics by kind. Through the fake engine (its
recurrent records are the state after each position) and the invariant checker."""

from __future__ import annotations

import pytest
from conftest import make_config
from fake_engine import FakeEngine
from test_recurrent import MakeManager, T, decode, hybrid_layers, prefill, state_group, toks

from kv_cache_manager_v2 import KVCacheManager
from kv_cache_manager_v2._common import MAX_CAPACITY

PREFIX = 1000  #: shared tokens: its last full block ends at 992
SHARED = PREFIX // T * T


def run(m: KVCacheManager, engine: FakeEngine, prompt: list[int], decoded: int = 0) -> int:
    """One request: probe, create (the probe's reuse), prefill cut at snapshot positions, decode,
    close; its reused tokens."""
    probed = m.probe_reuse(None, prompt)
    kv = m.create_kv_cache(input_tokens=prompt)
    assert kv.history_length == probed
    prefill(engine, kv, prompt, len(prompt), chunk=300)  # checks the reused prefix and state
    if decoded:
        decode(engine, kv, prompt + toks(99, decoded), len(prompt) + decoded)
    kv.close()
    m.check_invariants()
    return probed


@pytest.mark.parametrize("policy", ["branch", "auto"])
@pytest.mark.parametrize("suffix", [64, 376, 1300])
def test_a_branch_point_snapshot_gives_the_third_request_the_whole_shared_prefix(
    make_manager: MakeManager, policy: str, suffix: int
) -> None:
    m = make_manager(hybrid_layers(), T, quota=16 << 20, ssm_snapshot_policy=policy)
    engine = FakeEngine(m)
    prefix = toks(1, PREFIX)
    interval = 512 if policy == "auto" else 0  # "auto" keeps the interval snapshots too
    assert run(m, engine, prefix + toks(2, suffix)) == 0
    # the second leaves the first's path at 992 (no snapshot there yet): it plans one
    kv = m.create_kv_cache(input_tokens=prefix + toks(3, suffix))
    assert kv.next_snapshot_position(kv.history_length) == SHARED
    kv.close()
    assert run(m, engine, prefix + toks(3, suffix)) == interval
    assert m.reuse_statistics.snapshots_branch == 1
    assert run(m, engine, prefix + toks(4, suffix)) == SHARED
    stats = m.reuse_statistics
    assert (stats.snapshots_interval > 0) == (policy == "auto") and stats.snapshots_last == 3
    assert stats.attention_matched_tokens == 3 * SHARED  # the second (created twice) and third requests
    assert stats.reused_tokens == SHARED + 2 * interval


@pytest.mark.parametrize("suffix", [64, 376, 1300])
def test_the_interval_policy_reuses_up_to_the_last_multiple_of_the_interval(
    make_manager: MakeManager, suffix: int
) -> None:
    m = make_manager(hybrid_layers(), T, quota=16 << 20, ssm_snapshot_policy="interval")
    engine = FakeEngine(m)
    prefix = toks(1, PREFIX)
    for seed in (2, 3, 4):
        reused = run(m, engine, prefix + toks(seed, suffix))
    assert reused == 512
    assert m.reuse_statistics.snapshots_branch == 0


def test_demand_promotion_at_the_end_of_a_previous_output(make_manager: MakeManager) -> None:
    """A next turn whose attention match (the previous prompt and output) ends at a leaf one
    interval or more past its hybrid match (the previous prompt's last block) plans a snapshot
    there; a request sharing that conversation then reuses it."""
    m = make_manager(hybrid_layers(), T, quota=16 << 20, ssm_snapshot_policy="branch", ssm_reuse_interval=128)
    engine = FakeEngine(m)
    turn1 = toks(5, 200)
    answer = toks(99, 161)  # run() decodes (computes and commits) these tokens
    assert run(m, engine, turn1, decoded=len(answer)) == 0
    history = turn1 + answer
    end = len(history) // T * T  # 352: the output's last full block
    turn2 = history + toks(6, 50)
    kv = m.create_kv_cache(input_tokens=turn2)
    assert kv.history_length == 192
    assert kv.next_snapshot_position(192) == end
    kv.close()
    assert run(m, engine, turn2) == 192
    assert m.reuse_statistics.snapshots_demand == 1
    assert run(m, engine, history + toks(7, 40)) == end
    # a shorter gap (under one interval) plans nothing
    short = make_manager(hybrid_layers(), T, quota=16 << 20, ssm_snapshot_policy="branch", ssm_reuse_interval=512)
    engine = FakeEngine(short)
    run(short, engine, turn1, decoded=len(answer))
    kv = short.create_kv_cache(input_tokens=turn2)
    assert kv.next_snapshot_position(192) == (len(turn2) // T * T)
    kv.close()


def test_branch_policy_takes_no_interval_snapshot_auto_does(make_manager: MakeManager) -> None:
    m = make_manager(hybrid_layers(), T, quota=16 << 20, ssm_snapshot_policy="branch", ssm_reuse_interval=64)
    kv = m.create_kv_cache(input_tokens=toks(1, 300))
    assert [kv.next_snapshot_position(p) for p in (0, 287, 288)] == [288, 288, MAX_CAPACITY + 1]
    kv.close()
    auto = make_manager(hybrid_layers(), T, quota=16 << 20, ssm_reuse_interval=64, ssm_snapshot_policy="auto")
    kv = auto.create_kv_cache(input_tokens=toks(1, 300))  # "branch" and the interval snapshots
    assert [kv.next_snapshot_position(p) for p in (0, 256, 287, 288)] == [64, 288, 288, 320]
    kv.close()


def test_auto_takes_interval_snapshots_at_the_lowest_priority_with_a_host_tier(make_manager: MakeManager) -> None:
    """With a host tier "auto" keeps the interval snapshots too, at priority 0: under pressure they
    are the first pages moved down, and a match takes them from there (the state exact)."""
    m = make_manager(
        hybrid_layers(),
        T,
        quota=1 << 20,
        host_quota=8 << 20,
        ssm_snapshot_policy="auto",
        ssm_reuse_interval=64,
    )
    engine = FakeEngine(m)
    prompt = toks(1, 300)
    kv = m.create_kv_cache(input_tokens=prompt)
    assert [kv.next_snapshot_position(p) for p in (0, 64, 256)] == [64, 128, 288]
    kv.close()
    run(m, engine, prompt)
    stats = m.reuse_statistics
    assert stats.snapshots_interval == 4 and stats.snapshots_last == 1
    for _ in range(6):  # other requests push the reusable pages down to the host tier
        run(m, engine, toks(50 + _, 300))
    assert run(m, engine, prompt[:200] + toks(8, 20)) == 192
    assert m.get_tier_statistics(1).offloaded_pages > 0


def test_unused_snapshots_evicted_are_counted(make_manager: MakeManager) -> None:
    m = make_manager(hybrid_layers(), T, quota=1 << 20, ssm_snapshot_policy="interval", ssm_reuse_interval=64)
    engine = FakeEngine(m)
    prompt = toks(1, 300)
    run(m, engine, prompt)
    assert run(m, engine, prompt[:100] + toks(2, 10)) == 64
    for seed in range(10, 30):
        run(m, engine, toks(seed, 300))
    stats = m.reuse_statistics
    assert stats.snapshots_evicted > stats.snapshots_evicted_unused > 0
    assert stats.snapshots_evicted - stats.snapshots_evicted_unused <= stats.snapshots_reused


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match=r"ssm_snapshot_policy must be one of 'interval', 'branch', 'auto', got 'x'"):
        make_config(hybrid_layers(), T, ssm_snapshot_policy="x")
    with pytest.raises(TypeError, match="ssm_snapshot_policy"):
        make_config(hybrid_layers(), T, ssm_snapshot_policy=1)


def test_plan_snapshot(make_manager: MakeManager) -> None:
    """A position planned by the engine (e.g. the end of the output) is kept like the others;
    bad positions are refused; the interval policy ignores it."""
    m = make_manager(hybrid_layers(), T, quota=16 << 20, ssm_snapshot_policy="branch")
    engine = FakeEngine(m)
    prompt = toks(1, 100)
    kv = m.create_kv_cache(input_tokens=prompt)
    with pytest.raises(ValueError, match="position must be >= 0, got -32"):
        kv.plan_snapshot(-32)
    with pytest.raises(TypeError):
        kv.plan_snapshot("64")  # type: ignore[arg-type]
    kv.plan_snapshot(0)  # nothing: no full block
    kv.plan_snapshot(31)
    kv.plan_snapshot(96)  # the prompt end: planned already
    assert [kv.next_snapshot_position(p) for p in (0, 96)] == [96, MAX_CAPACITY + 1]
    kv.plan_snapshot(190)  # the last full block: 160
    assert [kv.next_snapshot_position(p) for p in (0, 96)] == [96, 160]
    seq = prompt + toks(2, 80)
    prefill(engine, kv, prompt, 100)
    decode(engine, kv, seq, 170)
    kv.close()
    assert m.reuse_statistics.snapshots_last == 2
    assert run(m, engine, seq[:170] + toks(3, 5)) == 160
    plain = make_manager(hybrid_layers(), T, quota=16 << 20, ssm_snapshot_policy="interval")
    kv = plain.create_kv_cache(input_tokens=prompt)
    kv.plan_snapshot(160)
    assert kv.next_snapshot_position(96) == 512
    kv.close()


@pytest.mark.parametrize(("policy", "interval_priority"), [("interval", 35), ("auto", 0)])
def test_auto_gives_interval_snapshots_the_lowest_priority(
    make_manager: MakeManager, policy: str, interval_priority: int
) -> None:
    """Without a lower tier too: "auto"'s interval snapshots are evicted before any other snapshot
    or KV (priority 0); the prompt's last block keeps the callback's priority."""
    m = make_manager(hybrid_layers(), T, quota=16 << 20, ssm_snapshot_policy=policy, ssm_reuse_interval=64)
    run(m, FakeEngine(m), toks(1, 300))
    g = state_group(m)
    priorities = {
        (node.ordinal + 1) * T: page.priority for node in m._tree.nodes() if (page := node.page(g)) is not None
    }
    assert priorities == {
        64: interval_priority,
        128: interval_priority,
        192: interval_priority,
        256: interval_priority,
        288: 35,
    }
