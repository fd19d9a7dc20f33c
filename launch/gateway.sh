#!/usr/bin/env bash
# The OpenAI-compatible HTTP gateway in front of a coordinator.
#   launch/gateway.sh --host 0.0.0.0 --port 8000 --coordinator coordinator-host:50051
# (several coordinators: --coordinator 10.0.0.1:50051,10.0.0.2:50051 or dns:///name:50051;
# a stream whose coordinator dies continues through another)
# Every flag has a SPLITSERVE_* twin (SPLITSERVE_COORDINATOR, SPLITSERVE_PORT, ...): see --help.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
exec "$SPLITSERVE" gateway "$@"
