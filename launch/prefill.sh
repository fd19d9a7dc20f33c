#!/usr/bin/env bash
# One prefill worker: computes prompts, pushes their KV layer by layer over UCX.
#   SPLITSERVE_CLUSTER_TOKEN=... launch/prefill.sh --coordinator coord-host:50052 --host 0.0.0.0 --advertise-host $(hostname) \
#       --model /models/llama.gguf --kv-cache-gib 8 --cpu-affinity 0-15 [--ucx-tls rc,cuda_copy]
# Model, dtype and block size must match the decode workers' (checked at the KV handshake).
# (--coordinator: the coordinator's internal port; the token: the cluster's shared secret)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
exec "$SPLITSERVE" prefill "$@"
