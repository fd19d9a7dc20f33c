"""Folds one ``bench/gpu/run.sh`` run into ``OUT_DIR/gpu-run.json``.

Reads what the run's steps left in ``OUT_DIR``: ``steps.tsv`` (name, status, seconds per
step), ``gpu-tests.xml`` (pytest's JUnit report of the ``gpu``-marked tests),
``kv_transfer.json``, ``kernel_bench.json``, ``step_times.json`` and ``serve_goodput.json``
(the benchmarks' reports); a missing file is recorded as missing, never guessed. Prints the
summary JSON too.

    python bench/gpu/summarize.py OUT_DIR --dry 0
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def read_steps(path: Path) -> list[dict[str, object]]:
    steps = []
    for line in path.read_text().splitlines() if path.exists() else []:
        name, status, seconds = line.split("\t")
        steps.append({"name": name, "status": status, "seconds": int(seconds)})
    return steps


def read_tests(path: Path) -> dict[str, object]:
    """Counts and failures of a JUnit XML report (pytest's ``--junitxml``)."""
    if not path.exists():
        return {"missing": path.name}
    root = ElementTree.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures, skip_reasons = [], set()
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            counts["failed"] += 1
            failures.append({"test": name, "message": (failed.get("message") or "")[:500]})
        elif skipped is not None:
            counts["skipped"] += 1
            skip_reasons.add(skipped.get("message") or "")
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures, "skip_reasons": sorted(skip_reasons)}


def read_json(path: Path) -> object:
    if not path.exists():
        return {"missing": path.name}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        return {"unreadable": f"{path.name}: {error}"}


def summarize(out: Path, dry: bool) -> dict[str, object]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "dry": dry,
        "host": {"python": platform.python_version(), "machine": platform.machine()},
        "steps": read_steps(out / "steps.tsv"),
        "gpu_tests": read_tests(out / "gpu-tests.xml"),
        "kv_transfer": read_json(out / "kv_transfer.json"),
        "kernel_bench": read_json(out / "kernel_bench.json"),
        "step_times": read_json(out / "step_times.json"),
        "serve_goodput": read_json(out / "serve_goodput.json"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dry", type=int, choices=(0, 1), default=0)
    args = parser.parse_args()
    summary = summarize(args.out, bool(args.dry))
    text = json.dumps(summary, indent=2)
    (args.out / "gpu-run.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
