"""The in-flight cap from memory (``common/memory_budget.py``): the smaller of the machine's
and the cgroup's headroom, v1 and v2, "no limit" ignored, a fallback where nothing is known."""

from __future__ import annotations

from pathlib import Path

from splitserve.common.memory_budget import available_bytes, stream_cap
from splitserve.coordinator.main import inflight_cap

GIB = 1 << 30


def _root(tmp_path: Path, mem_available_kb: int | None, cgroup: dict[str, str]) -> Path:
    if mem_available_kb is not None:
        (tmp_path / "proc").mkdir()
        (tmp_path / "proc/meminfo").write_text(
            f"MemTotal:       99999999 kB\nMemAvailable:   {mem_available_kb} kB\n"
        )
    for relative, text in cgroup.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return tmp_path


def test_the_smaller_of_the_machine_and_the_cgroup(tmp_path: Path) -> None:
    v2 = {"sys/fs/cgroup/memory.max": str(2 * GIB), "sys/fs/cgroup/memory.current": str(GIB)}
    root = _root(tmp_path, 8 * 1024 * 1024, v2)  # 8 GiB on the machine, 1 GiB left in cgroup
    assert available_bytes(root) == GIB
    cap = stream_cap(64 * 1024, 0.25, 1024, root=root)
    assert cap.streams == GIB // 4 // (64 * 1024) == 4096
    assert "0.25 of 1.0 GiB available / 64 KiB a stream" in cap.describe()


def test_cgroup_v1_and_no_limit(tmp_path: Path) -> None:
    v1 = {
        "sys/fs/cgroup/memory/memory.limit_in_bytes": str(9223372036854771712),  # no limit
        "sys/fs/cgroup/memory/memory.usage_in_bytes": str(GIB),
    }
    root = _root(tmp_path, 4 * 1024 * 1024, v1)
    assert available_bytes(root) == 4 * GIB  # the machine's figure alone
    (root / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text(f"{3 * GIB}\n")
    assert available_bytes(root) == 2 * GIB
    v2_unlimited = {"sys/fs/cgroup/memory.max": "max", "sys/fs/cgroup/memory.current": "5"}
    _root(root, None, v2_unlimited)
    assert available_bytes(root) == 2 * GIB  # v2 says no limit: v1's figure stands


def test_unknown_memory_falls_back_and_the_flag_wins(tmp_path: Path) -> None:
    cap = stream_cap(64 * 1024, 0.25, 1024, root=tmp_path)
    assert cap.streams == 1024 and "unknown" in cap.describe()
    assert stream_cap(64 * 1024, 0.25, 1024, available=1024).streams == 64  # the minimum
    assert inflight_cap(300).streams == 300
