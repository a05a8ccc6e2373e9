"""SIGTERM for the simulator's command line: it ends a run as Ctrl-C does (``main``'s clean-up: its
private redis-server stopped, its temporary directory removed), with exit code 143."""

from __future__ import annotations

import signal
import threading
from typing import Any


class Terminated(BaseException):
    """SIGTERM, raised in the main thread."""


def interrupted(e: BaseException) -> int | None:
    """The exit code of a run ended by Ctrl-C (130) or SIGTERM (143), also where the clean-up of the
    call it interrupted raised in turn (the interruption is then in ``e``'s context chain: a
    manager call cut short by the signal refuses the next call); None for any other error."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return 130
        if isinstance(seen, Terminated):
            return 128 + signal.SIGTERM
        seen = seen.__context__
    return None


def _on_sigterm(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not interrupt the clean-up
    raise Terminated


def catch_sigterm() -> Any:
    """Install the SIGTERM handler (main thread only); returns the handler to restore, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    return signal.SIG_DFL if previous is None else previous
