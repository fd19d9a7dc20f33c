#!/usr/bin/env bash
# One prefill worker: computes prompts, pushes their KV layer by layer over UCX.
#   launch/prefill.sh --coordinator coord-host:50051 --host 0.0.0.0 --advertise-host $(hostname) \
#       --model /models/llama.gguf --kv-cache-gib 8 --cpu-affinity 0-15 [--ucx-tls rc,cuda_copy]
# Model, dtype and block size must match the decode workers' (checked at the KV handshake).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
exec "$SPLITSERVE" prefill "$@"
