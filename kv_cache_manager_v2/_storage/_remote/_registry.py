"""The remote tier's backends, one line each: the URL schemes a backend serves, the module (in this
package, imported only when a URL names it) and the ``RemoteBackend`` class it defines, and the
package extra that installs what it needs. Adding a backend is one module and one line here."""

from __future__ import annotations

import importlib
from typing import Any, Final

#: (URL schemes, module, class, extra)
BACKENDS: Final[tuple[tuple[tuple[str, ...], str, str, str], ...]] = (
    (("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://"), "_redis", "RedisBackend", "remote"),
    (("mooncake://",), "_mooncake", "MooncakeBackend", "mooncake"),
)

#: every URL scheme some backend serves
REMOTE_URL_SCHEMES: Final[tuple[str, ...]] = tuple(scheme for entry in BACKENDS for scheme in entry[0])


def backend_of(url: str) -> tuple[str, str, str]:
    """The (module, class, extra) of the backend serving ``url`` (ValueError: no backend does)."""
    for schemes, module, cls, extra in BACKENDS:
        if url.startswith(schemes):
            return module, cls, extra
    raise ValueError(f"no remote backend serves this URL scheme; the schemes are {REMOTE_URL_SCHEMES}")


def backend_class(url: str) -> Any:
    """The ``RemoteBackend`` class serving ``url``, its module imported now (a backend's client library
    is imported only when a backend is opened; ValueError: no backend serves ``url``)."""
    module, cls, _ = backend_of(url)
    return getattr(importlib.import_module(f"{__name__.rpartition('.')[0]}.{module}"), cls)


def check_url(url: str) -> None:
    """ValueError (saying what is wrong and what is allowed) where the backend serving ``url`` refuses it."""
    backend_class(url).check_url(url)
