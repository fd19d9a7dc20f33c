#!/usr/bin/env bash
# One decode worker: reserves KV blocks, receives pushed KV, batches decoding, streams tokens.
#   SPLITSERVE_CLUSTER_TOKEN=... launch/decode.sh --coordinator coord-host:50052 --host 0.0.0.0 --advertise-host $(hostname) \
#       --model /models/llama.gguf --kv-cache-gib 32 [--ucx-tls ...] [--ucx-error-handling]
# (--coordinator: the coordinators' internal ports, comma-separated; the token: the cluster's
# shared secret). Many machines: --etcd-endpoints etcd-host:2379 instead of --coordinator.
# SIGTERM drains (--drain-timeout, default 30 s) and exits 0.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
exec "$SPLITSERVE" decode "$@"
