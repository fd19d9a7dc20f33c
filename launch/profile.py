"""``splitserve profile --out PROFILE [engine flags]``: measure a worker on this machine into a
versioned profile (``engine/sim_profile.py:SimProfile``, version ``PROFILE_VERSION``).

What it measures, each by the real thing:

- step times: the real engine's prefill and decode steps under a serving worker's phases of
  load, fitted to the step-cost model with its held-out error (``engine/sim_calibrate.py``,
  run as its own process pinned as ``up`` pins a worker; ``--from-steps DIR`` fits a served
  worker's step logs instead), and the model's KV bytes per token;
- the KV link: bandwidth and one-way latency between two processes over UCX
  (``transfer/link_probe.py:measure_link``; ``--ucx-tls tcp`` for the TCP path a link between
  hosts takes; ``--transfer-gbps`` / ``--transfer-latency-ms`` record a link measured
  elsewhere instead);
- start-up: from starting a process with the engine flags to its first token
  (``splitserve generate --max-tokens 1``: imports, weights, kernels, first step);
  ``--no-startup`` skips it.

A simulated worker (``--engine sim --sim-profile PROFILE``) waits out the step times and paces
its KV transfers on the link (``transfer/paced.py``); ``splitserve plan`` sizes a fleet from
the same file. Everything after the known flags goes to the engine (``--model``, ``--dtype``,
``--threads``, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from splitserve.engine.sim_profile import load_profile
from splitserve.transfer.link_probe import measure_link
from splitserve.transfer.ucx_settings import UcxSettings

STARTUP_TIMEOUT_S = 600.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve profile", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    parser.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    parser.add_argument(
        "--from-steps", type=Path, default=None, help="fit a served worker's step logs (*.jsonl)"
    )
    parser.add_argument("--ucx-tls", default=None, help="UCX transports of the link measured")
    parser.add_argument(
        "--transfer-gbps", type=float, default=None, help="record this link bandwidth, Gbit/s"
    )
    parser.add_argument(
        "--transfer-latency-ms", type=float, default=0.0, help="... and this one-way latency"
    )
    parser.add_argument("--no-startup", action="store_true", help="do not time a start-up")
    return parser


def startup_s(engine_args: Sequence[str]) -> float:
    """Seconds from starting ``splitserve generate --max-tokens 1`` with ``engine_args`` to
    its exit with its token; ``RuntimeError`` when it fails."""
    command = [sys.executable, "-m", "splitserve.launch.cli", "generate", "Hello"]
    started = time.perf_counter()
    done = subprocess.run(
        [*command, "--max-tokens=1", *engine_args],
        capture_output=True,
        text=True,
        timeout=STARTUP_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the start-up run failed: {done.stderr.strip()[-500:]}")
    return time.perf_counter() - started


def _step_profile(args: argparse.Namespace, engine_args: Sequence[str], out: Path) -> None:
    """Fit the step times (``engine/sim_calibrate.py`` in its own process) into ``out``."""
    command = [sys.executable, "-m", "splitserve.engine.sim_calibrate", f"--out={out}"]
    if args.from_steps is not None:
        command.append(f"--from-steps={args.from_steps}")
    done = subprocess.run([*command, *engine_args], check=False)
    if done.returncode != 0:
        raise RuntimeError(f"fitting the step times failed (exit {done.returncode})")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, engine_args = parser.parse_known_args(argv)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            steps = Path(scratch) / "steps.json"
            _step_profile(args, engine_args, steps)
            profile = load_profile(steps)
        if args.transfer_gbps is None:
            link = asyncio.run(measure_link(UcxSettings(tls=args.ucx_tls)))
            gbps, latency_s, how = link.gbps, link.latency_s, f"measured over {link.transports}"
        else:
            gbps, latency_s, how = args.transfer_gbps, args.transfer_latency_ms / 1000, "given"
        started = 0.0 if args.no_startup else startup_s(engine_args)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        print(f"splitserve profile: {error}", file=sys.stderr)
        return 1
    profile = dataclasses.replace(
        profile,
        transfer_gbps=round(gbps, 3),
        transfer_latency_s=round(latency_s, 6),
        startup_s=round(started, 3),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(profile.to_json(), encoding="utf-8")
    print(
        f"KV {profile.kv_bytes_per_token} bytes a token; link {gbps:.2f} Gbit/s, "
        f"{latency_s * 1e6:.0f} us one way ({how}); start-up to first token "
        f"{started:.1f} s; wrote {args.out} (version {profile.version})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
