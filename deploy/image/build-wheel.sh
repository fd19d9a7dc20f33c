#!/bin/sh
# The image's builder stage (deploy/Dockerfile), also run by `make image-dry` without Docker:
# a wheel of splitserve whose C++ CPU kernels are compiled for every instruction-set level
# (setup.py, kernels/cpu_levels.py), so the runtime stage needs no compiler.
#   deploy/image/build-wheel.sh OUT_DIR       (from the repository root; needs g++)
set -eu
out=${1:?usage: build-wheel.sh OUT_DIR}
python3 -m pip wheel --no-cache-dir --no-deps --wheel-dir "$out" .
python3 - "$out" <<'PY'
import sys, zipfile, pathlib
wheel = next(pathlib.Path(sys.argv[1]).glob("splitserve-*.whl"))
libraries = [n for n in zipfile.ZipFile(wheel).namelist() if "/_cpu_" in n and n.endswith(".so")]
print(f"{wheel.name}: {len(libraries)} kernel libraries")
if not libraries:
    sys.exit("the wheel holds no kernel library: is g++ installed in this stage?")
PY
