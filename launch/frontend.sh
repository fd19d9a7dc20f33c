#!/usr/bin/env bash
# A coordinator and the OpenAI-compatible gateway in one process (the gateway's streams reach
# the coordinator without gRPC):
#   launch/frontend.sh --host 0.0.0.0 --port 50051 --internal-port 50052 --http-port 8000
# Every coordinator flag applies (see launch/coordinator.sh); --http-port, --request-timeout,
# --max-body-bytes and --http-log-level are the gateway's. Every flag has a SPLITSERVE_* twin.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
exec "$SPLITSERVE" frontend "$@"
