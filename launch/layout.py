"""How ``splitserve up`` lays one machine's cores out over the two phases (``--layout``).

Layouts (``LAYOUTS``):
- ``split``: one prefill and one decode worker, each pinned to half the cores (disaggregated,
  the path between machines too);
- ``aggregated``: one dual-role worker on every core (``--dual 1``): one batch decodes on all
  cores, and prompts are chunked into its steps;
- ``hybrid``: ``split``'s two workers, each also running its steps on the other's cores
  while that one's engine idles (``--core-lending both``, ``engine/step_threads.py``): a
  prompt computed on every core while no request decodes, a decode step reading the weights
  with every core's bandwidth while no prompt waits;
- ``auto``: ``hybrid`` or ``aggregated``, whichever a queueing model of the probe's
  measurements (``ProbeResult``, cached per machine and configuration) says serves the higher
  request rate within the latency targets, ``aggregated`` by at least ``AGGREGATED_MARGIN``.

``hybrid`` is modelled as ``split`` (``PAIR_LAYOUTS``): a lower bound, since each worker takes
the other's cores only while that one idles, and keeps taking them only where its own steps
measure faster on them (``StepThreads``). So ``auto`` runs the worker pair lending: on the
2-core Cascade Lake Xeon (2026-11-28, 3 seeds each) ``hybrid`` served 3.4-3.6x split's
goodput on long prompts and the same as split on chat at 0.3-0.6 req/s, within the spread
between seeds (bench/log/2026-11.md, "Hybrid, the layout auto runs for a worker pair"); the model
has no term for what lending gains.

The model (``capacity``), for requests of ``prompt_tokens`` in and ``output_tokens`` out
arriving as a Poisson stream at rate ``rate``; ``P``: one prompt's time on the layout's
prefill cores; ``d(B) = d1 + s (B - 1)``: a decode step of ``B`` requests on its decode cores
(``PhaseTimes.decode_step_s``):
- ``split``: the prefill worker is an M/D/1 queue of load ``rho = rate * P``: TTFT = P (1 +
  rho / (2 (1 - rho))) + d(B). By Little's law ``B = rate * output_tokens * ITL``, and ITL =
  d(B), so ITL = (d1 - s) / (1 - s * rate * output_tokens).
- ``aggregated``: the engine spends ``f = rate * P`` of its time on prompts, which stretches
  every request's decode by 1 / (1 - f): ITL = (d1 - s) / (1 - f - s * rate *
  output_tokens); TTFT as for ``split`` with ``rho = f``.
A rate is within the targets when the predicted TTFT and ITL are at most ``HEADROOM`` of them
(the model predicts means; a request's own latency spreads around them). ``capacity`` is the
highest such rate (bisection: both predictions grow with the rate).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from splitserve.common.cpu_info import cpu_name
from splitserve.common.env_flags import env_name
from splitserve.common.errors import ModelLoadError
from splitserve.common.layout_probe import PhaseTimes, ProbeResult
from splitserve.common.model_files import resolve_model_path

LAYOUTS = ("auto", "split", "aggregated", "hybrid")
PAIR_LAYOUTS = ("split", "hybrid")
"""The layouts of one prefill and one decode worker, half the cores each: one model."""
CHOSEN_BY_MODEL = ("hybrid", "aggregated")
"""``auto``'s candidates."""
MODELLED = (*PAIR_LAYOUTS, "aggregated")
"""The layouts the model predicts (and the online re-check follows)."""
HEADROOM = 0.8
"""Predicted means must stay within this share of the targets."""
AGGREGATED_MARGIN = 2.0
"""``aggregated`` replaces ``split`` only where predicted to serve at least this much more. The
model is kinder to ``aggregated`` than serving was, every time it was checked: on the 2-core
Cascade Lake Xeon of 2026-11-27 it predicted aggregated at 0.90x of split's rate and
aggregated served 0.75-0.78x of split's goodput at 0.5 req/s (2 seeds); it predicted
0.39-0.74x where aggregated served 0.30x and 0 at 0.3 and 0.6 req/s (bench/log/2026-11.md, "The
layout make serve picks"). Once decode steps ran their layer loop in C (a 2-thread step of 8
requests 35 ms against 47-56 on one thread) it predicted 1.15-1.6x, and aggregated served
0.13x of split's goodput at 0.6 req/s and 0.5x at 0.9 (3 seeds each; bench/log/2026-11.md, "The
decode layer loop in C"). What it leaves out: the other processes on the cores (relaying
threads, the coordinator, the gateway, the clients) preempting a thread of the engine's
parallel regions, each of a step's ~240 kernel calls waiting for it, and a prompt step
stalling every stream of the batch at once. The next lever is measuring served steps, not a
probe's: re-checking the layout online from the step times placement learns. On the AMD EPYC
(bf16, 2026-11-28) it predicted aggregated at 1.14x the pair's rate, and aggregated served
0.87x of hybrid's goodput at 1 req/s and 0.52x at 2 (3 seeds each)."""
RECHECK_INTERVAL_S = 60.0
"""``--layout-recheck-s``'s default (``launch/layout_recheck.py``)."""
PROBE_VERSION = 1
"""Part of the cache key: a new probe or model invalidates older results."""
PROBE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Workload:
    """The requests and targets a layout is chosen for (the chat workload's by default)."""

    prompt_tokens: int = 320
    output_tokens: int = 96
    ttft_s: float = 2.0
    itl_s: float = 0.05

    def __post_init__(self) -> None:
        if min(self.prompt_tokens, self.output_tokens) <= 0 or min(self.ttft_s, self.itl_s) <= 0:
            raise ValueError("a workload needs positive token counts and targets")


@dataclass(frozen=True)
class Prediction:
    """A layout's predicted mean latencies at one rate (inf: the layout cannot keep up)."""

    rate: float
    ttft_s: float
    itl_s: float

    def within(self, workload: Workload) -> bool:
        return self.ttft_s <= HEADROOM * workload.ttft_s and self.itl_s <= HEADROOM * workload.itl_s


@dataclass(frozen=True)
class LayoutChoice:
    """The layout ``up`` runs and why."""

    layout: str
    reason: str
    capacities: tuple[tuple[str, float], ...] = ()
    """Each candidate's predicted rate within the targets, req/s (``auto`` only)."""
    carried: tuple[CarriedCost, ...] = ()
    """The serving costs ``comparable`` carried onto probed times for ``capacities``."""
    probe: ProbeResult | None = None
    """The machine's probe the choice was (or, for a named layout, could have been) made
    from: what the online re-check corrects (``launch/layout_recheck.py``); None: none."""
    probe_path: Path | None = None
    """Where ``probe`` is cached."""

    @property
    def summary(self) -> str:
        """The reason, short, for the startup line."""
        if not self.capacities:
            return self.reason
        rates = " / ".join(f"{layout} {rate:.2f}" for layout, rate in self.capacities)
        return f"auto: {rates} req/s predicted within the targets"


def layout_phase(probe: ProbeResult, layout: str) -> PhaseTimes:
    """The times of ``layout``'s engines, prompts and decode alike: ``split``'s (and
    ``hybrid``'s) workers on half the cores each, ``aggregated``'s one worker on all of them."""
    if layout in PAIR_LAYOUTS:
        return probe.half_cores
    if layout == "aggregated":
        return probe.all_cores
    raise ValueError(f"no model for layout {layout!r}")


@dataclass(frozen=True)
class CarriedCost:
    """What serving cost the engine on ``source`` threads (its served times over its probed
    ones, each phase), carried over to the probe's times on ``target`` threads, which no
    cluster has served from this cache yet."""

    source: int
    target: int
    prefill: float
    decode_one: float
    decode_batch: float

    def applied(self, phase: PhaseTimes) -> PhaseTimes:
        return PhaseTimes(
            phase.threads,
            phase.prefill_s * self.prefill,
            phase.decode_one_s * self.decode_one,
            phase.decode_batch_s * self.decode_batch,
        )

    def describe(self) -> str:
        return (
            f"the {self.target}-thread probe x the {self.source}-thread engine's served/probed "
            f"(prompt {self.prefill:.2f}, decode step {self.decode_one:.2f} / "
            f"{self.decode_batch:.2f})"
        )


def comparable(probe: ProbeResult) -> tuple[ProbeResult, tuple[CarriedCost, ...]]:
    """``probe`` with served and probed times made comparable: each thread count not served
    takes the serving cost of the widest served count below it (``CarriedCost``); the costs
    carried are second.

    Why: served times carry everything probing leaves out (the coordinator, the gateway, the
    client, the partner worker on the same cores, the served workload's own prompt lengths),
    so a served layout set beside another's probe always looks the worse of the two. On the
    Cascade Lake Xeon (2026-11-28) a long-prompt run's served ``hybrid`` (0.58 req/s predicted,
    against 0.91 probed) set beside ``aggregated``'s probe (1.20) made the next ``up`` start
    ``aggregated`` for chat, where the two then served the same. A step spread over more
    threads waits on every core's neighbours, so it pays at least a narrower step's serving
    cost: carried upwards, the cost is a lower bound. Not carried downwards: ``aggregated``
    served slower than probed says nothing about how a 1-thread worker would serve, so the
    pair keeps its probe's times and the re-check can still leave ``aggregated``. Where every
    count is served the two sides are served against served and nothing is carried."""
    carried: list[CarriedCost] = []
    phases = []
    for phase in probe.phases:
        below = [t for t in probe.served if t < phase.threads]
        if phase.threads in probe.served or not below:
            phases.append(phase)
            continue
        source = max(below)
        served = next(p for p in probe.phases if p.threads == source)
        probed = probe.probed_phase(source)
        cost = CarriedCost(
            source,
            phase.threads,
            served.prefill_s / probed.prefill_s,
            served.decode_one_s / probed.decode_one_s,
            served.decode_batch_s / probed.decode_batch_s,
        )
        carried.append(cost)
        phases.append(cost.applied(phase))
    if not carried:
        return probe, ()
    return dataclasses.replace(probe, phases=tuple(phases)), tuple(carried)


def predict(probe: ProbeResult, workload: Workload, layout: str, rate: float) -> Prediction:
    """Mean TTFT and ITL of ``layout`` at ``rate`` req/s (see the module docstring)."""
    prefill = decode = layout_phase(probe, layout)
    prompt_s = prefill.prefill_s * workload.prompt_tokens / probe.prompt_tokens
    load = rate * prompt_s
    slope = decode.decode_per_request_s
    busy = load if layout == "aggregated" else 0.0  # share of the decode engine's time on prompts
    denominator = 1.0 - busy - slope * rate * workload.output_tokens
    if load >= 1.0 or denominator <= 0.0:
        return Prediction(rate, float("inf"), float("inf"))
    itl = (decode.decode_one_s - slope) / denominator
    batch = rate * workload.output_tokens * itl
    ttft = prompt_s * (1.0 + load / (2.0 * (1.0 - load))) + decode.decode_step_s(batch)
    return Prediction(rate, ttft, itl)


def capacity(probe: ProbeResult, workload: Workload, layout: str) -> float:
    """The highest rate (req/s) whose predictions are within the targets; 0.0 if none."""
    low, high = 0.0, 1.0
    while predict(probe, workload, layout, high).within(workload):
        low, high = high, high * 2
        if high > 1e6:
            return low
    if not predict(probe, workload, layout, 1e-9).within(workload):
        return 0.0
    for _ in range(40):
        middle = (low + high) / 2
        if predict(probe, workload, layout, middle).within(workload):
            low = middle
        else:
            high = middle
    return low


def choose(measured: ProbeResult, workload: Workload) -> LayoutChoice:
    """``auto``'s choice: ``aggregated`` where its capacity is at least ``AGGREGATED_MARGIN``
    times ``hybrid``'s, else ``hybrid`` (the worker pair, the layout between machines too).
    Where neither meets the targets at any rate, the one of the lower predicted latency at a
    trickle of requests. Served and probed times are first made ``comparable``."""
    probe, carried = comparable(measured)
    capacities = tuple((layout, capacity(probe, workload, layout)) for layout in CHOSEN_BY_MODEL)
    rates = dict(capacities)
    best_layout = (
        "aggregated" if rates["aggregated"] >= AGGREGATED_MARGIN * rates["hybrid"] else "hybrid"
    )
    if max(rates.values()) <= 0.0:

        def trickle_cost(layout: str) -> float:
            prediction = predict(probe, workload, layout, 1e-6)
            return prediction.ttft_s / workload.ttft_s + prediction.itl_s / workload.itl_s

        best_layout = min(CHOSEN_BY_MODEL, key=trickle_cost)
    targets = f"TTFT {workload.ttft_s:g} s / ITL {workload.itl_s * 1e3:g} ms"
    listed = ", ".join(f"{layout} {rate:.2f}" for layout, rate in capacities)
    reason = (
        f"predicted req/s within {targets} for {workload.prompt_tokens}+"
        f"{workload.output_tokens}-token requests: {listed} (aggregated needs "
        f"{AGGREGATED_MARGIN:g}x hybrid's)" + "".join(f"; {cost.describe()}" for cost in carried)
    )
    return LayoutChoice(best_layout, reason, capacities, carried)


def roles_of_layout(layout: str) -> tuple[int, int, int, str]:
    """(prefill, decode, dual-role workers, --core-lending) of a named layout."""
    if layout == "split":
        return 1, 1, 0, "off"
    if layout == "hybrid":
        return 1, 1, 0, "both"
    if layout == "aggregated":
        return 0, 0, 1, "off"
    raise ValueError(f"not a layout to run: {layout!r}")


def probe_cache_path(worker_args: Sequence[str], workload: Workload) -> Path:
    """Where this machine's probe for these worker flags is cached: keyed by the CPU, the
    cores this process may use, the model file's identity (``default`` resolved to its
    file), the flags, the engine's environment variables and this checkout's engine and
    kernel sources (``code_identity``), so an upgrade probes again."""
    model = last_flag(worker_args, "--model") or os.environ.get(env_name("--model"), "default")
    try:
        path = resolve_model_path(model)
        stat = path.stat()
        model_identity = f"{path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"
    except (OSError, ModelLoadError):
        model_identity = model
    key_parts = [
        str(PROBE_VERSION),
        code_identity(),
        cpu_name(),
        str(len(os.sched_getaffinity(0))),
        model_identity,
        shlex.join(worker_args),
        str(workload.prompt_tokens),
        *(f"{name}={os.environ[name]}" for name in sorted(os.environ) if _engine_env(name)),
    ]
    digest = hashlib.sha256("\n".join(key_parts).encode()).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "splitserve" / f"layout-probe-{digest}.json"


@functools.cache
def code_identity() -> str:
    """A digest of the sources that decide what the probe measures (``engine/*.py`` and
    ``kernels/``, Python and C++)."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for pattern in ("engine/*.py", "kernels/**/*.py", "kernels/**/*.cpp", "kernels/**/*.h"):
        for source in sorted(package.glob(pattern)):
            digest.update(source.relative_to(package).as_posix().encode())
            digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def _engine_env(name: str) -> bool:
    """Environment twins of engine flags (``engine/cli_args.py``) change what is probed, and
    so do torch's instruction-set caps (with ``SPLITSERVE_CPU_LEVEL``, an AVX-512 machine
    probes as an AVX2-only one)."""
    if name in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        return True
    return name.startswith("SPLITSERVE_") and name not in {
        "SPLITSERVE_CLUSTER_TOKEN",
        "SPLITSERVE_API_KEYS",
    }


def last_flag(argv: Sequence[str], name: str) -> str | None:
    """The value of the last ``name=value`` or ``name value`` in ``argv``; None if absent."""
    value = None
    for index, arg in enumerate(argv):
        if arg == name and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def cached_probe(path: Path) -> ProbeResult | None:
    """The probe cached at ``path``; None where there is none (or it cannot be read)."""
    try:
        return ProbeResult.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None


def cache_probe(path: Path, probe: ProbeResult) -> None:
    """Write ``probe`` to ``path`` whole (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(probe.to_json(), indent=1), encoding="utf-8")
    partial.replace(path)


def load_or_probe(
    worker_args: Sequence[str], workload: Workload, say: Callable[[str], None] = print
) -> tuple[ProbeResult, bool]:
    """The cached probe for these flags, or a fresh one (run in a child process with the
    workers' flags, then cached); second: whether it came from the cache. Raises
    ``RuntimeError`` when the probe fails."""
    path = probe_cache_path(worker_args, workload)
    cached = cached_probe(path)
    if cached is not None:
        return cached, True
    say(f"splitserve up: measuring this machine to choose the layout (once; cached in {path})")
    argv = [
        sys.executable,
        "-m",
        "splitserve.engine.layout_probe",
        f"--out={path}",
        f"--prompt-tokens={workload.prompt_tokens}",
        *worker_args,
    ]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise RuntimeError(f"the layout probe took over {PROBE_TIMEOUT_S:.0f} s") from error
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"the layout probe failed ({done.returncode}): {' | '.join(tail)}")
    try:
        return ProbeResult.from_json(json.loads(path.read_text(encoding="utf-8"))), False
    except (OSError, ValueError) as error:
        raise RuntimeError(f"the layout probe wrote no result: {error}") from error


def workload_of(text: str) -> Workload:
    """'320,96,2000,50' -> ``Workload``; ``ValueError`` on anything else."""
    parts = text.split(",")
    if len(parts) != 4:
        raise ValueError(f"--layout-workload takes 4 comma-separated numbers, not {text!r}")
    prompt, output, ttft_ms, itl_ms = parts
    return Workload(int(prompt), int(output), float(ttft_ms) / 1000, float(itl_ms) / 1000)
