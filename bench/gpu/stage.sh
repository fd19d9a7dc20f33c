# Sourced by the GPU scripts: stage_package REPO prints a temporary folder under which the
# repo's folders are linked as the package `splitserve` (pyproject.toml's package-dir), for
# PYTHONPATH: the GPU image has no network to pip-install the project.
stage_package() {
    local repo=$1 stage package
    stage=$(mktemp -d)
    mkdir -p "$stage/splitserve"
    for package in common engine kernels proto transfer prefill decode coordinator worker \
        gateway client launch discovery; do
        ln -s "$repo/$package" "$stage/splitserve/$package"
    done
    echo "$stage"
}
