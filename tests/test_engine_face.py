"""The engine's face: code outside ``engine/`` reaches the engine only through ``AsyncEngine``
and the typed objects it hands out (``engine/engine_face.py``, ``engine/engine_report.py``).

The guard is an ast scan of every module outside ``engine/`` (each package folder, and
``bench/``). A module fails it when it

- imports an engine-internal module (``ENGINE_INTERNALS``: the core, its scheduler, block
  pool, KV cache manager, model runner, requests, reservation queue), however it spells the
  import; or
- reads or writes an attribute named in ``FORBIDDEN_ATTRIBUTES`` (``x.core``,
  ``x.scheduler``, ...), whatever ``x`` is: the names are the engine's internals, and no
  other code of the project uses them.

``ALLOWED`` names the few modules that may, each with its reason; an entry that no longer
breaks the rule fails too, so the list only shrinks.

The behavioural half: the worker's metrics, which read only the engine's published reports,
still see the scheduler's counters and every finished request's phases, and a caller that
saw a request's last output already finds it in the report.
"""

from __future__ import annotations

import ast
import asyncio
import logging
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.engine.engine_report import EngineReport
from splitserve.worker.metrics import install_engine_metrics
from tests.conftest import assert_no_leaks, make_llm

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("common", "transfer", "kernels", "proto", "discovery", "worker", "prefill", "decode")
SCANNED += ("coordinator", "gateway", "frontend", "client", "launch", "bench")
"""Every folder of code outside ``engine/`` (``tests/`` may look inside the engine)."""
ENGINE_INTERNALS = frozenset(
    f"splitserve.engine.{name}"
    for name in (
        "engine_core",
        "scheduler",
        "block_pool",
        "kv_cache_manager",
        "model_runner",
        "request",
        "reservation_queue",
    )
)
FORBIDDEN_ATTRIBUTES = frozenset({"core", "_core", "scheduler", "block_pool", "kv_cache_manager"})
ALLOWED: dict[str, str] = {
    "bench/splitserve_runner.py": "measures the synchronous EngineCore itself (step() in a "
    "loop, as engine/llm.py drives it): no AsyncEngine, no worker, nothing on another thread",
    "bench/gpu/step_times.py": "times the synchronous EngineCore's steps on a GPU (step() in a "
    "loop, as engine/llm.py drives it): no AsyncEngine, no worker, nothing on another thread",
    "bench/bench_quantized.py": "times the synchronous EngineCore's decode with widened and "
    "quantized weights, one engine per format in one process: no AsyncEngine, no worker",
    "bench/bench_structured.py": "times the synchronous EngineCore's steps with and without a "
    "grammar, and its grammar matchers' masks: no AsyncEngine, no worker",
    "bench/bench_speculative.py": "times the synchronous EngineCore's steps with and without "
    "speculation and reads its draft counters: no AsyncEngine, no worker, no other thread",
    "bench/bench_sampling.py": "times the synchronous EngineCore's sampled decode steps with "
    "the sampler's nucleus tiers and without: no AsyncEngine, no worker, no other thread",
    "bench/bench_prompt_logprobs.py": "times the synchronous EngineCore's prompts with and "
    "without prompt logprobs: no AsyncEngine, no worker, no other thread",
    "bench/bench_lora.py": "times the synchronous EngineCore's decode steps with LoRA "
    "adapters' rows and without: no AsyncEngine, no worker, no other thread",
    "bench/gpu/kernel_compile.py": "runs a ModelRunner's graph capture on the CPU under the "
    "Triton interpreter to record the kernels' launches: no engine, no request, no thread",
}


def _imported_modules(node: ast.AST) -> list[str]:
    """Every module an import statement names, submodules taken from ``from pkg import mod``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return []


def violations_in(source: str) -> list[str]:
    """What in ``source`` (a module's text) reaches past the engine's face, one line each."""
    found: set[tuple[int, str]] = set()
    for node in ast.walk(ast.parse(source)):
        for module in _imported_modules(node):
            if module in ENGINE_INTERNALS:
                found.add((node.lineno, f"imports {module}"))
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRIBUTES:
            found.add((node.lineno, f".{node.attr}"))
    return [f"{line}: {what}" for line, what in sorted(found)]


def _scan() -> dict[str, list[str]]:
    """Module path (relative to the root) -> its violations, for modules that have any."""
    result = {}
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found = violations_in(path.read_text())
            if found:
                result[str(path.relative_to(ROOT))] = found
    return result


def test_nothing_outside_the_engine_reaches_past_its_face() -> None:
    found = _scan()
    offenders = {path: lines for path, lines in found.items() if path not in ALLOWED}
    assert not offenders, "reaches into the engine past AsyncEngine's face:\n" + "\n".join(
        f"  {path}:{line}" for path, lines in offenders.items() for line in lines
    )
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"allowed but no longer reaching in (drop them from ALLOWED): {stale}"


def test_every_package_outside_the_engine_is_scanned() -> None:
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert packages - {"engine", "tests"} <= set(SCANNED)


def test_the_rule_catches_each_way_in() -> None:
    """The scan is not vacuous: each spelling of a reach counts."""
    reaches = (
        "from splitserve.engine.engine_core import EngineCore",
        "from splitserve.engine import scheduler",
        "import splitserve.engine.block_pool",
        "stats = engine.core.scheduler.stats",
        "engine._core.release_blocks([1])",
        "pool = manager.block_pool",
    )
    for source in reaches:
        assert violations_in(source), source
    allowed = (
        "from splitserve.engine.async_engine import AsyncEngine",
        "from splitserve.engine.engine_face import CompletedPrompt, EngineFacts, PagedKv",
        "from prometheus_client.core import GaugeMetricFamily",
        "stats = engine.latest_report.stats",
        "config.runner.decodes",
    )
    for source in allowed:
        assert not violations_in(source), source


LABELS = {"model_name": "model", "role": "decode"}
PROMPT = list(range(100, 120))
FOUR = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)


def _value(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value(f"splitserve_{name}", LABELS)


def test_the_metrics_see_the_scheduler_counters_and_each_ended_requests_phases(
    default_checkpoint_fp32: LoadedCheckpoint, caplog: pytest.LogCaptureFixture
) -> None:
    """Through the reports alone, with no waiting: when a caller has seen an output, the
    report that shows it is out, and its listeners have run."""
    llm = make_llm(default_checkpoint_fp32, num_blocks=64)
    engine = AsyncEngine(llm.engine)
    registry = CollectorRegistry()
    install_engine_metrics(registry, engine, "model", "decode")

    def failing(report: EngineReport) -> None:
        raise RuntimeError("a broken listener")

    engine.add_report_listener(failing)  # logged; the engine and the other listeners go on
    assert engine.facts.vocab_size == llm.engine.model_config.vocab_size
    assert engine.facts.num_blocks == 64

    async def scenario() -> None:
        tokens = [o async for o in engine.generate("done", PROMPT, FOUR)]
        assert tokens[-1].update.finish_reason is not None
        assert _value(registry, "generation_tokens_total") == 4
        assert _value(registry, "prompt_tokens_total") == len(PROMPT)
        for phase in ("queue", "prefill", "decode", "inference"):
            assert _value(registry, f"request_{phase}_time_seconds_count") == 1, phase
        assert engine.latest_report.stats.num_finished_requests == 1

        stream = engine.generate("aborted", [7, *PROMPT], LONG)
        await anext(stream)
        assert _value(registry, "num_requests_running") == 1
        await stream.aclose()  # aborts the running request
        await engine.call(lambda: None)  # the abort's command has run, its report is out
        assert _value(registry, "num_requests_running") == 0
        assert _value(registry, "request_inference_time_seconds_count") == 2
        assert engine.latest_report.stats.num_finished_requests == 2

    try:
        with caplog.at_level(logging.ERROR):
            asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    finally:
        engine.shutdown()
    assert "an engine report listener failed" in caplog.text
    assert_no_leaks(llm)
