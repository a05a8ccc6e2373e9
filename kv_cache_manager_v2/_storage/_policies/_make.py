"""A pool group's evictors under the policy a manager names (``_storage/_policy_registry.py``)."""

from __future__ import annotations

import importlib

from ..._page import Evictor
from .._policy_registry import policy_of


def pool_group_evictors(policy: str, slots: list[int]) -> list[Evictor]:
    """The evictors of one pool group under ``policy``, one per cache level (``slots[level]``
    slots each, top first)."""
    module, function = policy_of(policy)
    make = getattr(importlib.import_module(f"{__name__.rpartition('.')[0]}.{module}"), function)
    evictors: list[Evictor] = make(slots)
    return evictors
