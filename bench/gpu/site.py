"""The packages a lent GPU machine lacks, as one carried archive (bench/gpu/README.md).

The GPU image (Python 3.12, torch, no network) has neither UCX (ucxx and the RAPIDS libraries
it loads) nor the serving stack's grpcio 1.85 / protobuf 7 / OpenTelemetry. Their wheels
(`make gpu-wheels`, `make gpu-serve-wheels`) and the tree together exceed what one device call
carries (64 MiB), so ``build`` installs both sets for CPython 3.12 into one folder, drops what
nothing on the GPU machine opens, and packs the rest into ``.gpu-site.tar.xz``:

    python bench/gpu/site.py build .gpu-site.tar.xz .whl .whl-serve   # here (make gpu-site)
    python bench/gpu/site.py install /tmp/site     # there (run.sh, serve.sh): the archive,
                                                   # else the wheels in .whl/ and .whl-serve/
    python bench/gpu/site.py check .gpu-site.tar.xz   # the dry run: lists, unpacks, resolves

What ``build`` drops (STRIPPED), and why none of it is opened at run time:

- C/C++ headers (``<package>/include/``, Cython ``.pxd``/``.pyx`` and C++ sources), static
  and libtool archives (``.a``, ``.la``), CMake and pkg-config files, ``.pyi`` stubs: inputs
  to compilers and type checkers; no Python file in the wheels names them (``get_include`` and
  the like do not exist there) and the libraries' loaders (``libucx/load.py``,
  ``libucxx/load.py``, ``librmm/load.py``, ``rapids_logger/load.py``) open only
  ``lib/*.so`` and ``lib64/*.so``;
- UCX's perftest: the ``ucx_perftest``/``io_demo``/``ucx_read_profile`` programs, their
  examples under ``libucx/share`` and the perftest module ``lib/ucx/libucx_perftest_cuda.so*``
  (framework ``ucx_perftest``, a name no UCX library the transport loads contains, so only the
  perftest program loads it); ``ucx_info`` stays, for looking at UCX by hand;
- ``bin/``: console scripts whose first line names this machine's interpreter.

Identical files in one folder (UCX ships ``libucp.so``, ``libucp.so.0`` and
``libucp.so.0.0.0`` as three copies: wheels have no links) become links to the longest name, as
an ordinary install has them: every name still opens the same bytes.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import importlib.machinery
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
ARCHIVE = ".gpu-site.tar.xz"
STAMP = ".gpu-site.sha256"  # in the site: the archive it was unpacked from
WHEEL_DIRS = (".whl", ".whl-serve")
# The wheels are for the GPU image's CPython 3.12 on x86-64 Linux (the Makefile's download).
TARGET = [
    "--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
    "--platform", "manylinux_2_24_x86_64", "--platform", "manylinux_2_17_x86_64",
    "--platform", "manylinux2014_x86_64",
]  # fmt: skip
# What the GPU steps import from the site; ``check`` and ``build`` insist on each.
REQUIRED = (
    "ucxx", "rmm", "libucx", "libucxx", "librmm", "rapids_logger", "grpc", "grpc_health",
    "grpc_reflection", "google.protobuf", "google.rpc", "opentelemetry.sdk",
    "opentelemetry.exporter.otlp.proto.grpc", "gguf",
)  # fmt: skip
STRIPPED_SUFFIXES = (".a", ".la", ".pxd", ".pyx", ".pyi", ".cpp", ".h", ".hpp", ".cuh")
STRIPPED_NAMES = ("CMakeLists.txt",)
UCX_TOOLS_KEPT = ("ucx_info",)
MTIME = 1_577_836_800  # every member's time (2020-01-01): the same wheels pack the same bytes


def stripped_reason(relative: str, is_dir: bool) -> str | None:
    """Why the path (relative to the site, ``/``-separated) is dropped, or None if it stays."""
    parts = relative.split("/")
    name = parts[-1]
    if is_dir:
        if len(parts) == 2 and name == "include":
            return "headers"
        if name in ("cmake", "pkgconfig"):
            return "cmake/pkg-config"
        if relative in ("bin", "libucx/share"):
            return "scripts and examples"
        return None
    if name.endswith(STRIPPED_SUFFIXES) or name in STRIPPED_NAMES:
        return "build inputs"
    if parts[:2] == ["libucx", "bin"] and name not in UCX_TOOLS_KEPT:
        return "UCX test and profiling tools"
    if parts[:3] == ["libucx", "lib", "ucx"] and name.startswith("libucx_perftest"):
        return "UCX test and profiling tools"
    return None


def tree_bytes(root: Path) -> int:
    return sum(path.lstat().st_size for path in root.rglob("*") if not path.is_dir())


def strip(root: Path) -> dict[str, int]:
    """Drops what ``stripped_reason`` names; the bytes dropped by reason."""
    dropped: dict[str, int] = collections.Counter()
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for name in list(dirnames):
            reason = stripped_reason((here / name).relative_to(root).as_posix(), True)
            if reason:
                dropped[reason] += tree_bytes(here / name)
                shutil.rmtree(here / name)
                dirnames.remove(name)
        for name in filenames:
            reason = stripped_reason((here / name).relative_to(root).as_posix(), False)
            if reason:
                dropped[reason] += (here / name).lstat().st_size
                (here / name).unlink()
    for dirpath, _, _ in sorted(os.walk(root), key=lambda entry: -len(entry[0])):
        if dirpath != str(root) and not os.listdir(dirpath):
            os.rmdir(dirpath)
    return dict(dropped)


def link_copies(root: Path) -> int:
    """Identical files in one folder become links to the longest name; the bytes saved."""
    saved = 0
    for dirpath, _, filenames in os.walk(root):
        groups: dict[tuple[int, str], list[str]] = collections.defaultdict(list)
        for name in filenames:
            path = Path(dirpath, name)
            if path.is_symlink() or path.stat().st_size < 4096:
                continue
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            groups[(path.stat().st_size, digest)].append(name)
        for (size, _), names in groups.items():
            keep = max(names, key=lambda name: (len(name), name))
            for name in names:
                if name != keep:
                    os.unlink(Path(dirpath, name))
                    os.symlink(keep, Path(dirpath, name))
                    saved += size
    return saved


def normalized(member: tarfile.TarInfo) -> tarfile.TarInfo:
    member.uid = member.gid = 0
    member.uname = member.gname = ""
    member.mtime = MTIME
    return member


def pack(root: Path, archive: Path) -> None:
    partial = archive.with_name(archive.name + ".partial")
    with tarfile.open(partial, "w:xz", preset=9) as tar:
        for path in sorted(root.rglob("*")):
            tar.add(path, arcname=path.relative_to(root).as_posix(), recursive=False,
                    filter=normalized)  # fmt: skip
    partial.replace(archive)


def missing_packages(site: Path) -> list[str]:
    """The REQUIRED modules the import system does not find under ``site`` (found, not run:
    the binaries are CPython 3.12's)."""
    missing = []
    for name in REQUIRED:
        path = [str(site)]
        for part in name.split("."):
            spec = importlib.machinery.PathFinder.find_spec(part, path)
            if spec is None:
                missing.append(name)
                break
            path = list(spec.submodule_search_locations or [])
    return missing


def build(archive: Path, wheel_dirs: list[Path]) -> int:
    wheels = sorted(wheel for folder in wheel_dirs for wheel in folder.glob("*.whl"))
    if not wheels:
        print(f"no wheels in {', '.join(map(str, wheel_dirs))}: make gpu-wheels gpu-serve-wheels")
        return 2
    for wheel in wheels:
        print(f"wheel {wheel.stat().st_size:>11,} {wheel.name}")
    print(f"wheels {sum(wheel.stat().st_size for wheel in wheels):>10,} together")
    sys.stdout.flush()  # before pip's own output
    with tempfile.TemporaryDirectory(prefix="gpu-site-") as work:
        root = Path(work, "site")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
             "--no-compile", "--disable-pip-version-check", "--target", str(root), *TARGET,
             *map(str, wheels)],
            check=True,
        )  # fmt: skip
        print(f"installed {tree_bytes(root):>8,}")
        for reason, size in sorted(strip(root).items()):
            print(f"  dropped {size:>10,} {reason}")
        print(f"  linked  {link_copies(root):>10,} identical copies")
        print(f"stripped {tree_bytes(root):>9,} ({sum(1 for _ in root.rglob('*'))} entries)")
        missing = missing_packages(root)
        if missing:
            print(f"missing after stripping: {missing}")
            return 1
        started = time.monotonic()
        pack(root, archive)
    print(f"archive {archive.stat().st_size:>10,} {archive} ({time.monotonic() - started:.0f} s)")
    return 0


def unpack(archive: Path, site: Path) -> int:
    """Unpacks into a fresh ``site``; the number of members."""
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    with tarfile.open(archive, "r:xz") as tar:
        members = tar.getmembers()
        if hasattr(tarfile, "data_filter"):  # links must stay inside the site
            tar.extractall(site, filter="data")
        else:
            tar.extractall(site)
    return len(members)


def check(archive: Path) -> int:
    """What the dry run does with an archive here: list it, unpack it into a temporary folder,
    every link resolving inside it and every REQUIRED package found."""
    started = time.monotonic()
    try:
        with tarfile.open(archive, "r:xz") as tar:
            names = tar.getnames()
    except (tarfile.TarError, lzma.LZMAError, EOFError) as error:
        print(f"{archive}: unreadable ({error})")
        return 1
    print(f"{archive}: {archive.stat().st_size:,} bytes, {len(names)} members")
    with tempfile.TemporaryDirectory(prefix="gpu-site-check-") as work:
        site = Path(work, "site")
        count = unpack(archive, site)
        inside = site.resolve()
        broken = [
            str(path.relative_to(site))
            for path in site.rglob("*")
            if path.is_symlink() and not (path.exists() and path.resolve().is_relative_to(inside))
        ]
        missing = missing_packages(site)
        print(f"unpacked {count} members, {tree_bytes(site):,} bytes, "
              f"in {time.monotonic() - started:.1f} s")  # fmt: skip
    if broken or missing or count != len(names):
        print(f"broken links: {broken}; missing packages: {missing}")
        return 1
    print(f"every link resolves; found: {', '.join(REQUIRED)}")
    return 0


def install(site: Path, repo: Path) -> int:
    """The archive if it travelled, else the wheels of .whl/ and .whl-serve/ (pip); neither:
    ``site`` stays as it is (a warm machine keeps it)."""
    archive = repo / ARCHIVE
    if archive.exists():
        started = time.monotonic()
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        stamp = site / STAMP
        if stamp.exists() and stamp.read_text() == digest:  # run.sh unpacked it, then serve.sh
            print(f"{site} already holds {archive.name} ({digest[:12]})")
            return 0
        count = unpack(archive, site)
        stamp.write_text(digest)
        print(f"unpacked {archive.name} ({digest[:12]}) into {site}: {count} members, "
              f"{time.monotonic() - started:.1f} s")  # fmt: skip
        return 0
    wheels = sorted(str(wheel) for folder in WHEEL_DIRS for wheel in (repo / folder).glob("*.whl"))
    if not wheels:
        print(f"neither {ARCHIVE} nor wheels in {'/, '.join(WHEEL_DIRS)}/: {site} as it is")
        return 0
    return subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--no-cache-dir", "--upgrade", "--target", str(site), *wheels],
    ).returncode  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="the archive from the wheel folders")
    build_parser.add_argument("archive", type=Path)
    build_parser.add_argument("wheel_dirs", type=Path, nargs="+")
    check_parser = commands.add_parser("check", help="list, unpack and resolve an archive")
    check_parser.add_argument("archive", type=Path)
    install_parser = commands.add_parser("install", help="the carried packages into SITE")
    install_parser.add_argument("site", type=Path)
    install_parser.add_argument("--repo", type=Path, default=REPO)
    args = parser.parse_args()
    if args.command == "build":
        return build(args.archive, args.wheel_dirs)
    if args.command == "check":
        return check(args.archive)
    return install(args.site, args.repo)


if __name__ == "__main__":
    sys.exit(main())
