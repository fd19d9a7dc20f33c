# Sourced by the role scripts: find the splitserve executable (repo venv first, then PATH).
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ -x "$HERE/../.venv/bin/splitserve" ]; then
  SPLITSERVE="$HERE/../.venv/bin/splitserve"
else
  SPLITSERVE="$(command -v splitserve)" || { echo "splitserve is not installed (run make install)" >&2; exit 1; }
fi
