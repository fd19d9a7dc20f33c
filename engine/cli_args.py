"""The one place where command-line flags and ``SPLITSERVE_*`` environment variables become config.

Every engine flag has an environment twin (``--kv-cache-gib`` <-> ``SPLITSERVE_KV_CACHE_GIB``);
a flag given on the command line wins over the environment, which wins over the default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from splitserve.common.env_flags import comma_separated
from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.settings import add_settings_args, setting
from splitserve.engine.config import (
    DTYPES,
    ENGINES,
    QUANTIZED_WEIGHTS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    RunnerConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

SERVED_SPECULATIVE_TOKENS = 4
"""Prompt-lookup drafts per request and step on a served worker on the CPU unless told
otherwise (on CUDA 0: not measured there yet; ``EngineConfig``'s own default, for engines made
in-process, stays 0). Drafts are weighed against their rows' cost (``engine/scheduler.py``): where
few are kept, few are proposed. On the AMD EPYC (2026-11-28) ``make serve``'s
goodput with drafts was within the spread of the same tree without them (chat at 1.5 and 2
req/s: 8 of 12 seed pairs higher; long prompts at 0.5: 2 of 6, medians 0.96x), while repetitive
prompts decode 1.1-1.6x faster (``bench/bench_speculative.py``). Output is the plain path's
token for token (greedy, seeded sampling)."""
_DEFAULTS = EngineConfig()


@dataclass(frozen=True)
class EngineSettings:
    """The engine's flags (``EngineConfig``), declared once (``common/settings.py``): the
    offline commands' and every worker's parser are generated from it."""

    TITLE: ClassVar[str] = "engine"
    model: str = setting(
        _DEFAULTS.model.model,
        "GGUF file, HF folder, 'default', or random:SHAPE[:SEED] (random weights drawn on "
        "--device at start: llama-8b, llama-1b, tiny; engine/random_shapes.py)",
    )
    dtype: str = setting(
        _DEFAULTS.model.dtype,
        "compute dtype; auto = bf16 where the CPU has it",
        choices=DTYPES,
    )
    quantized_weights: str = setting(
        _DEFAULTS.model.quantized_weights,
        "a GGUF's Q4_1/Q8_0 weights: widen to --dtype, or native: decode rows read them as "
        "stored; auto: native in bf16, widen in float32",
        choices=QUANTIZED_WEIGHTS,
    )
    lora_modules: str = setting(
        "",
        "LoRA adapters served beside the model, name=folder[,name=folder...]: PEFT's saved "
        "adapters (adapter_config.json, adapter_model.safetensors); a request names one as "
        "its model",
    )
    max_lora_adapters: int = setting(
        _DEFAULTS.model.max_lora_adapters,
        "the most LoRA adapters served at once (--lora-modules and runtime loads); up to 8 "
        "loaded, a step with an adapter's rows multiplies by all of them",
    )
    max_lora_rank: int = setting(
        _DEFAULTS.model.max_lora_rank,
        "the largest rank of a LoRA adapter served (vLLM's flag): one above it is refused at "
        "start or load; 0: any",
    )
    max_loras: int = setting(
        _DEFAULTS.scheduler.max_loras,
        "the most distinct LoRA adapters among the running requests (vLLM's flag): a request "
        "of another adapter waits until one of those has no request left, so a step "
        "multiplies by no more adapters; 0: no bound",
    )
    enable_lora: bool = setting(
        False,
        "accepted for vLLM's command lines: LoRA adapters are always served here (with "
        "--lora-modules, or loaded at runtime with --lora-dir)",
    )
    max_model_len: int | None = setting(None, "context window cap in tokens")
    block_size: int = setting(_DEFAULTS.cache.block_size, "tokens per KV block")
    kv_cache_gib: float = setting(_DEFAULTS.cache.kv_cache_gib, "KV cache size in GiB")
    num_blocks: int | None = setting(None, "KV cache size in blocks (overrides --kv-cache-gib)")
    no_prefix_caching: bool = setting(False, "disable prefix caching")
    max_num_batched_tokens: int = setting(
        _DEFAULTS.scheduler.max_num_batched_tokens, "token budget per step (prefill chunk size)"
    )
    max_num_seqs: int = setting(_DEFAULTS.scheduler.max_num_seqs, "most running requests")
    threads: int | None = setting(None, "torch intra-op threads")
    device: str = setting(
        _DEFAULTS.runner.device,
        "torch device of the weights and the KV cache: cpu, or cuda / cuda:N (the Triton "
        "kernels; KV moves between GPUs over UCX)",
    )
    engine: str = setting(
        _DEFAULTS.runner.engine,
        "model: run the model; sim: wait out each step's time from --sim-profile and emit set "
        "tokens, no weights loaded (for scale tests)",
        choices=ENGINES,
    )
    sim_profile: str = setting(
        _DEFAULTS.runner.sim_profile,
        "a simulated engine's step-time profile (python -m splitserve.engine.sim_calibrate "
        "writes one), or 'default'",
    )
    sim_startup_s: float | None = setting(
        None,
        "a simulated worker serves this many seconds after its process started, as the real "
        "one would (default: the profile's measured start-up, startup_s; 0 where unmeasured)",
    )
    record_steps: str | None = setting(
        None,
        "log every engine step's shape and time in this directory (steps-<pid>-*.jsonl), for "
        "python -m splitserve.engine.sim_calibrate --from-steps",
    )
    no_cuda_graphs: bool = setting(
        False,
        "on CUDA, run decode steps eagerly instead of replaying CUDA graphs captured per "
        "batch size",
    )
    no_steps_ahead: bool = setting(
        False,
        "on CUDA graphs, read each decode step's tokens before launching the next (by "
        "default the next plain greedy decode step is launched first)",
    )
    speculative_tokens: int | None = setting(
        None,
        "prompt-lookup draft tokens per request and decode step (0: no speculation; default "
        f"{SERVED_SPECULATIVE_TOKENS} on the CPU, 0 on CUDA)",
    )
    speculative_max_rows: int = setting(
        _DEFAULTS.speculative.max_step_rows, "no drafts once a decode step holds this many rows"
    )


def add_engine_args(parser: argparse.ArgumentParser, env: Mapping[str, str] = os.environ) -> None:
    """Flags of ``EngineSettings``; defaults come from ``SPLITSERVE_*`` variables when set."""
    add_settings_args(parser.add_argument_group("engine"), EngineSettings, env)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the validated root config from parsed flags."""
    return EngineConfig(
        model=ModelConfig(
            model=args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            quantized_weights=args.quantized_weights,
            lora_modules=parse_lora_modules(args.lora_modules),
            max_lora_adapters=args.max_lora_adapters,
            max_lora_rank=args.max_lora_rank,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            kv_cache_gib=args.kv_cache_gib,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_loras=args.max_loras,
        ),
        runner=RunnerConfig(
            num_threads=args.threads,
            device=args.device,
            engine=args.engine,
            sim_profile=args.sim_profile,
            record_steps=args.record_steps,
            cuda_graphs=not args.no_cuda_graphs,
            steps_ahead=not args.no_steps_ahead,
        ),
        speculative=SpeculativeConfig(
            num_tokens=served_speculative_tokens(args.speculative_tokens, args.device),
            max_step_rows=args.speculative_max_rows,
        ),
    )


def parse_lora_modules(raw: str) -> tuple[tuple[str, str], ...]:
    """``--lora-modules``' (name, folder) pairs from ``name=folder[,name=folder...]``;
    ``InvalidRequestError`` (param ``lora_modules``) for an item without a name and a folder."""
    modules = []
    for item in comma_separated(raw):
        name, equals, folder = item.partition("=")
        if not equals or not name.strip() or not folder.strip():
            raise InvalidRequestError(
                f"--lora-modules takes name=folder items, not {item!r}", param="lora_modules"
            )
        modules.append((name.strip(), folder.strip()))
    return tuple(modules)


def served_speculative_tokens(asked: int | None, device: str) -> int:
    """The drafts a served worker takes: what its flag or environment asked, else
    ``SERVED_SPECULATIVE_TOKENS`` on the CPU and 0 elsewhere."""
    if asked is not None:
        return asked
    return SERVED_SPECULATIVE_TOKENS if device == "cpu" else 0


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``SamplingParams`` (validated when the params are built)."""
    group = parser.add_argument_group("sampling")
    defaults = SamplingParams()
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--temperature", type=float, default=0.7)
    group.add_argument("--top-p", type=float, default=defaults.top_p)
    group.add_argument("--top-k", type=int, default=defaults.top_k)
    group.add_argument("--min-p", type=float, default=defaults.min_p)
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--repetition-penalty", type=float, default=defaults.repetition_penalty)
    group.add_argument("--frequency-penalty", type=float, default=defaults.frequency_penalty)
    group.add_argument("--presence-penalty", type=float, default=defaults.presence_penalty)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")
    group.add_argument("--logprobs", type=int, default=None)


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
