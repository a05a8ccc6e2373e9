"""The remote tier's backends, one line each: the URL schemes a backend serves, the module (in this
package, imported only when a URL names it) and the ``RemoteBackend`` class it defines, and the
package extra that installs what it needs. Adding a backend is one module and one line here."""

from __future__ import annotations

from typing import Final

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
