#!/usr/bin/env bash
# The serving processes on a lent GPU machine (bench/gpu/README.md):
#
#   bench/gpu/serve.sh OUT_DIR [DEVICE]
#
# unpacks the packages that travelled into /tmp/site (.gpu-site.tar.xz, `make gpu-site`: UCX and
# the serving stack's packages the GPU image lacks or has too old; bench/gpu/site.py, which
# falls back to the wheels of .whl/ and .whl-serve/ and skips an archive run.sh already
# unpacked), links the repo as the package and runs bench/gpu/serve_check.py on DEVICE
# (default cuda): OUT_DIR/serve_check.json, serve.log.
# DEVICE cpu installs nothing and runs in the caller's environment. SERVE_SHAPE: the random
# model's shape (engine/random_checkpoint.py's SHAPES; default tiny).
set -u -o pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 OUT_DIR [DEVICE]" >&2
    exit 2
fi
out=$(mkdir -p "$1" && cd "$1" && pwd)
device=${2:-cuda}
repo=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-python3}
site=/tmp/site
path="$repo/bench${PYTHONPATH:+:$PYTHONPATH}"
if [ "$device" != cpu ]; then  # a CPU machine runs with its own environment
    "$py" "$repo/bench/gpu/site.py" install "$site" --repo "$repo" || exit 2
    path="$site:$path"
fi
source "$repo/bench/gpu/stage.sh"
stage=$(stage_package "$repo")
export PYTHONPATH="$stage:$path"
export PYTHONUNBUFFERED=1
"$py" "$repo/bench/gpu/serve_check.py" --device "$device" --out "$out/serve_check.json" \
    --shape "${SERVE_SHAPE:-tiny}" \
    >"$out/serve.log" 2>&1
status=$?
tail -40 "$out/serve.log"
rm -rf "$stage"
exit $status
