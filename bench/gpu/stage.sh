# Sourced by the GPU scripts: stage_package REPO prints a temporary folder under which the
# repo's folders are linked as the package `splitserve`, for PYTHONPATH: the GPU image has no
# network to pip-install the project. The folders are pyproject.toml's package-dir, read from
# it, so a package added there is staged too (a hand-kept list once missed `frontend`).
stage_package() {
    local repo=$1 stage package
    stage=$(mktemp -d)
    mkdir -p "$stage/splitserve"
    for package in $(sed -n 's/^"splitserve\.[a-z_]*" = "\([a-z_]*\)"$/\1/p' "$repo/pyproject.toml"); do
        ln -s "$repo/$package" "$stage/splitserve/$package"
    done
    echo "$stage"
}
