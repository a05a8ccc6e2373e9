"""What a simulated engine step costs in time.

The replay adds a step's work request by request (a prefill chunk, or one decode token, each after
the tokens already in the request's KV cache), then reads the step's compute time once
(``take_ms``), which also starts the next step's sum. A cost model sees the whole batch before it
answers, so it can take the larger of the compute-bound and the memory-bound time of the step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class StepCost(ABC):
    """The compute time of one engine step, from its work added request by request."""

    @abstractmethod
    def add_prefill(self, tokens: int, context: int) -> None:
        """A prefill chunk of ``tokens`` new tokens after ``context`` tokens already in the KV cache."""

    @abstractmethod
    def add_decode(self, context: int) -> None:
        """One decode token after ``context`` tokens already in the KV cache."""

    @abstractmethod
    def take_ms(self) -> float:
        """The step's time in milliseconds for the work added since the last call (then none is left)."""


class LinearCost(StepCost):
    """A fixed ``step_ms`` per step plus each token at ``tokens_per_s``, whatever the model and the
    context (``kv-cache-sim --step-ms/--tokens-per-s``: a calibration by hand)."""

    def __init__(self, step_ms: float, tokens_per_s: float) -> None:
        self.step_ms = step_ms
        self.tokens_per_s = tokens_per_s
        self._tokens = 0

    def add_prefill(self, tokens: int, context: int) -> None:
        self._tokens += tokens

    def add_decode(self, context: int) -> None:
        self._tokens += 1

    def take_ms(self) -> float:
        tokens = self._tokens
        self._tokens = 0
        return self.step_ms + tokens * 1000.0 / self.tokens_per_s
