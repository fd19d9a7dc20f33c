"""The one place where command-line flags and ``SPLITSERVE_*`` environment variables become config.

Every engine flag has an environment twin (``--kv-cache-gib`` <-> ``SPLITSERVE_KV_CACHE_GIB``);
a flag given on the command line wins over the environment, which wins over the default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping

from splitserve.common.env_flags import add_env_flag, env_default, truthy
from splitserve.common.sampling_params import SamplingParams
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


def add_engine_args(parser: argparse.ArgumentParser, env: Mapping[str, str] = os.environ) -> None:
    """Flags of ``EngineConfig``; defaults come from ``SPLITSERVE_*`` variables when set."""
    defaults = EngineConfig()
    group = parser.add_argument_group("engine")

    def flag(name: str, default: object, convert: Callable[[str], object], help_text: str) -> None:
        add_env_flag(group, name, default, convert, help_text, env)

    flag("--model", defaults.model.model, str, "GGUF file, HF folder, or 'default'")
    group.add_argument(
        "--dtype",
        choices=DTYPES,
        default=env_default("--dtype", defaults.model.dtype, str, env),
        help="compute dtype; auto = bf16 where the CPU has it (env SPLITSERVE_DTYPE)",
    )
    group.add_argument(
        "--quantized-weights",
        choices=QUANTIZED_WEIGHTS,
        default=env_default("--quantized-weights", defaults.model.quantized_weights, str, env),
        help="a GGUF's Q4_1/Q8_0 weights: widen to --dtype, or native: decode rows read them "
        "as stored; auto: native in bf16, widen in float32 (env SPLITSERVE_QUANTIZED_WEIGHTS)",
    )
    flag("--max-model-len", None, int, "context window cap in tokens")
    flag("--block-size", defaults.cache.block_size, int, "tokens per KV block")
    flag("--kv-cache-gib", defaults.cache.kv_cache_gib, float, "KV cache size in GiB")
    flag("--num-blocks", None, int, "KV cache size in blocks (overrides --kv-cache-gib)")
    group.add_argument(
        "--no-prefix-caching",
        action="store_true",
        default=env_default("--no-prefix-caching", False, truthy, env),
        help="disable prefix caching (env SPLITSERVE_NO_PREFIX_CACHING=1)",
    )
    flag(
        "--max-num-batched-tokens",
        defaults.scheduler.max_num_batched_tokens,
        int,
        "token budget per step (prefill chunk size)",
    )
    flag("--max-num-seqs", defaults.scheduler.max_num_seqs, int, "most running requests")
    flag("--threads", None, int, "torch intra-op threads")
    flag(
        "--device",
        defaults.runner.device,
        str,
        "torch device of the weights and the KV cache: cpu, or cuda / cuda:N (the Triton "
        "kernels; KV moves between GPUs over UCX)",
    )
    group.add_argument(
        "--engine",
        choices=ENGINES,
        default=env_default("--engine", defaults.runner.engine, str, env),
        help="model: run the model; sim: wait out each step's time from --sim-profile and "
        "emit set tokens, no weights loaded (for scale tests; env SPLITSERVE_ENGINE)",
    )
    flag(
        "--sim-profile",
        defaults.runner.sim_profile,
        str,
        "a simulated engine's step-time profile (python -m splitserve.engine.sim_calibrate "
        "writes one), or 'default'",
    )
    flag(
        "--record-steps",
        None,
        str,
        "log every engine step's shape and time in this directory (steps-<pid>-*.jsonl), for "
        "python -m splitserve.engine.sim_calibrate --from-steps",
    )
    flag(
        "--speculative-tokens",
        None,
        int,
        "prompt-lookup draft tokens per request and decode step (0: no speculation; default "
        f"{SERVED_SPECULATIVE_TOKENS} on the CPU, 0 on CUDA)",
    )
    flag(
        "--speculative-max-rows",
        defaults.speculative.max_step_rows,
        int,
        "no drafts once a decode step holds this many rows",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the validated root config from parsed flags."""
    return EngineConfig(
        model=ModelConfig(
            model=args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            quantized_weights=args.quantized_weights,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            kv_cache_gib=args.kv_cache_gib,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs
        ),
        runner=RunnerConfig(
            num_threads=args.threads,
            device=args.device,
            engine=args.engine,
            sim_profile=args.sim_profile,
            record_steps=args.record_steps,
        ),
        speculative=SpeculativeConfig(
            num_tokens=served_speculative_tokens(args.speculative_tokens, args.device),
            max_step_rows=args.speculative_max_rows,
        ),
    )


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
