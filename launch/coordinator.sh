#!/usr/bin/env bash
# The coordinator of one cluster (public gRPC API; workers register with it).
#   launch/coordinator.sh --host 0.0.0.0 --port 50051 --model /models/llama.gguf
# Every flag has a SPLITSERVE_* twin (SPLITSERVE_PORT, SPLITSERVE_MODEL, ...): see --help.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
exec "$SPLITSERVE" coordinator "$@"
