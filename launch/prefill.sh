#!/usr/bin/env bash
# One prefill worker: computes prompts, pushes their KV layer by layer over UCX.
#   SPLITSERVE_CLUSTER_TOKEN=... launch/prefill.sh --coordinator coord-host:50052 --host 0.0.0.0 --advertise-host $(hostname) \
#       --model /models/llama.gguf --kv-cache-gib 8 --cpu-affinity 0-15 [--ucx-tls rc,cuda_copy]
# Model, dtype and block size must match the decode workers' (checked at the KV handshake).
# (--coordinator: the coordinators' internal ports, comma-separated; the token: the cluster's
# shared secret). Many machines: --etcd-endpoints etcd-host:2379 instead of --coordinator.
# SIGTERM drains (--drain-timeout, default 30 s) and exits 0.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
exec "$SPLITSERVE" prefill "$@"
