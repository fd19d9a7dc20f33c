#!/usr/bin/env bash
# Everything on this machine: coordinator + prefill + decode workers (Ctrl-C stops all).
#   launch/up.sh [--prefill 1] [--decode 1] [--port 50051] [-- worker flags, e.g. --dtype float32]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
exec "$SPLITSERVE" up "$@"
