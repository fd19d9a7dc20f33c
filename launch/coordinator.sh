#!/usr/bin/env bash
# The coordinator of one cluster: public gRPC API on --port, worker membership on
# --internal-port (every call there needs the cluster credential: SPLITSERVE_CLUSTER_TOKEN,
# the same secret on every process of the cluster, e.g. `openssl rand -base64 32`).
#   SPLITSERVE_CLUSTER_TOKEN=... launch/coordinator.sh --host 0.0.0.0 --port 50051 \
#       --internal-port 50052 --model /models/llama.gguf
# Many machines: add --etcd-endpoints etcd-host:2379 (workers announce themselves there); run
# several coordinators and give clients / the gateway all of them (ip:port,ip:port).
# Every flag has a SPLITSERVE_* twin (SPLITSERVE_PORT, SPLITSERVE_MODEL, ...): see --help.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
exec "$SPLITSERVE" coordinator "$@"
