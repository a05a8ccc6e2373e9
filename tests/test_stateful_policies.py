"""The hybrid state machines of ``test_stateful.py`` with the other snapshot policies (issue 36):
branch-point, demand and last-block snapshots planned at admission, interval snapshots at the
lowest priority with lower tiers; live states, reused snapshots and matches checked as there."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from test_stateful import HybridBeamMachine, HybridMachine, HybridTieredMachine


class BranchHybridMachine(HybridMachine):
    SNAPSHOT_POLICY = "branch"


class AutoHybridMachine(HybridMachine):
    SNAPSHOT_POLICY = "auto"


class BranchHybridTieredMachine(HybridTieredMachine):
    SNAPSHOT_POLICY = "branch"


class AutoHybridTieredMachine(HybridTieredMachine):
    SNAPSHOT_POLICY = "auto"


class BranchHybridBeamMachine(HybridBeamMachine):
    SNAPSHOT_POLICY = "branch"


class AutoHybridBeamMachine(HybridBeamMachine):
    SNAPSHOT_POLICY = "auto"


for machine in (
    BranchHybridMachine,
    AutoHybridMachine,
    BranchHybridTieredMachine,
    AutoHybridTieredMachine,
    BranchHybridBeamMachine,
    AutoHybridBeamMachine,
):
    machine.TestCase.settings = settings(
        max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
    )
TestBranchHybridMachine = BranchHybridMachine.TestCase
TestAutoHybridMachine = AutoHybridMachine.TestCase
TestBranchHybridTieredMachine = BranchHybridTieredMachine.TestCase
TestAutoHybridTieredMachine = AutoHybridTieredMachine.TestCase
TestBranchHybridBeamMachine = BranchHybridBeamMachine.TestCase
TestAutoHybridBeamMachine = AutoHybridBeamMachine.TestCase
