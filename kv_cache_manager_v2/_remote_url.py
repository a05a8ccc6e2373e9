"""A remote tier's URL: the schemes the backends serve (``_storage/_remote/_registry``) and the check of
the backend a scheme names (``check_backend_url``), a URL with its password hidden, a cluster URL's seed
nodes (``RemoteCacheTierConfig`` checks its URL with them)."""

from __future__ import annotations

from ._storage._remote._registry import REMOTE_URL_SCHEMES as REMOTE_URL_SCHEMES
from ._storage._remote._registry import check_url

CLUSTER_URL_SCHEMES: tuple[str, ...] = ("redis+cluster://", "rediss+cluster://")


def check_backend_url(name: str, url: str) -> None:
    """ValueError (``name``, what is wrong, what is allowed) where the backend ``url``'s scheme names refuses it."""
    try:
        check_url(url)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def redact_url(url: str) -> str:
    """``url`` with its password (``user:password@`` or a ``password=`` query parameter) replaced by ``***``."""
    scheme_end = url.find("://")
    if scheme_end >= 0:
        rest = url[scheme_end + 3 :]
        at = rest.rfind("@", 0, _first_of(rest, "/?"))
        if at >= 0:
            userinfo = rest[:at]
            colon = userinfo.find(":")
            if colon >= 0:
                url = url[: scheme_end + 3] + userinfo[:colon] + ":***" + rest[at:]
    query = url.find("?")
    if query >= 0:
        params = url[query + 1 :].split("&")
        for i, p in enumerate(params):
            if p.lower().startswith("password="):
                params[i] = p[:9] + "***"
        url = url[: query + 1] + "&".join(params)
    return url


def _first_of(text: str, chars: str) -> int:
    """Index of the first of ``chars`` in ``text`` (its length when none occurs)."""
    found = [i for i in (text.find(c) for c in chars) if i >= 0]
    return min(found) if found else len(text)


def cluster_seed_nodes(url: str) -> list[tuple[str, int]]:
    """The ``host:port`` seed nodes of a ``redis+cluster://[user:password@]host:port[,host:port...][/0]``
    URL (ValueError naming the redacted URL when one is malformed)."""
    rest = url[url.find("://") + 3 :]
    rest = rest[: _first_of(rest, "/?")]
    rest = rest[rest.rfind("@") + 1 :]
    out: list[tuple[str, int]] = []
    for part in rest.split(","):
        host, colon, port = part.rpartition(":")
        host = host.strip("[]")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"cluster URL {redact_url(url)!r}: seed node {part!r} is not host:port")
        out.append((host, int(port)))
    return out
