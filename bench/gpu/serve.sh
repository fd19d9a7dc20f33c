#!/usr/bin/env bash
# The serving processes on a lent GPU machine (bench/gpu/README.md):
#
#   bench/gpu/serve.sh OUT_DIR [DEVICE]
#
# installs the wheels that travelled into /tmp/site (.whl: UCX, `make gpu-wheels`; .whl-serve:
# the serving stack's packages the GPU image lacks or has too old, `make gpu-serve-wheels`;
# the two together exceed what one call carries, so a first call installs .whl and a second,
# on the machine still warm, .whl-serve), links the repo as the package and runs
# bench/gpu/serve_check.py on DEVICE (default cuda): OUT_DIR/serve_check.json, serve.log.
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
    for wheels in .whl .whl-serve; do
        if ls "$repo/$wheels"/*.whl >/dev/null 2>&1; then
            "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$site" "$repo/$wheels"/*.whl || exit 2
        fi
    done
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
