"""Sessions and directives (values): the session id a request may carry (``SessionId``, checked
by ``check_session_id``), and what a directive did (``DirectiveOutcome`` of a ``DirectiveStatus``).
The mechanism: ``_core/_sessions.py`` (which blocks a session has) and ``_core/_directives.py``
(``KVCacheManager.directives``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from mypy_extensions import mypyc_attr

from ._common import SessionId

#: the longest session id accepted (characters)
MAX_SESSION_ID_LEN: Final = 256


def check_session_id(name: str, session_id: object) -> SessionId | None:
    """``session_id`` if it is None or a session id: a non-empty ``str`` of at most
    ``MAX_SESSION_ID_LEN`` characters (``TypeError`` for another type, ``ValueError`` for an empty
    or longer one)."""
    if session_id is None:
        return None
    if not isinstance(session_id, str):
        raise TypeError(f"{name} must be a str (a SessionId) or None, got {type(session_id).__name__} {session_id!r}")
    if not 0 < len(session_id) <= MAX_SESSION_ID_LEN:
        raise ValueError(
            f"{name} must be a non-empty str of at most {MAX_SESSION_ID_LEN} characters, got {session_id!r}"
        )
    return SessionId(str(session_id))  # (a str subclass becomes a plain str: ids compare and hash alike)


class DirectiveStatus(enum.Enum):
    """What a directive did (``DirectiveOutcome.status``)."""

    #: applied to every block it names that could take it (``num_blocks``; others share the rest)
    APPLIED = "applied"
    #: a pin: the blocks beyond the pin share of their tier were left unpinned (``num_kept``)
    CLIPPED = "clipped"
    #: some blocks take effect later (``num_deferred``): ``end``: in use by a request, they stay until
    #: released, then are evicted first; ``prefetch``: being read up in the background
    DEFERRED = "deferred"
    #: no block of the session or prefix is cached: nothing changed
    NOTHING_CACHED = "nothing_cached"


@mypyc_attr(native_class=False)
@dataclass(frozen=True)
class DirectiveOutcome:
    """A directive's answer: its ``status``; ``num_blocks``: the cached blocks it applied to now;
    ``num_deferred``: blocks in use that go once released (``end``), blocks being read up in the
    background (``prefetch``); ``num_kept``: blocks it
    names but left as they were (shared with another session, beyond the pin share, in use where
    nothing can wait, no room below)."""

    status: DirectiveStatus
    num_blocks: int = 0
    num_deferred: int = 0
    num_kept: int = 0
