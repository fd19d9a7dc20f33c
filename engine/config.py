"""Engine configuration: one frozen dataclass per component, composed into ``EngineConfig``.

Every field has a docstring and is validated in ``__post_init__`` (``InvalidRequestError`` with
the field name as ``param``). CLI flags and ``SPLITSERVE_*`` environment variables are read in
one place (``engine/cli_args.py``), never here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.common.errors import InvalidRequestError
from splitserve.common.load import DEFAULT_PREFILL_CHUNK_TOKENS
from splitserve.common.sampling_params import MAX_ADAPTER_NAME_CHARS

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZED_WEIGHTS = ("auto", "widen", "native")
ENGINES = ("model", "sim")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how."""

    model: str = "default"
    """Path to a GGUF file or a HF folder (config.json + safetensors), or "default"."""
    dtype: str = "auto"
    """Compute dtype: "auto" picks bfloat16 where the CPU has native bf16, else float32."""
    max_model_len: int | None = None
    """Context window override in tokens (at most the model's own); None keeps the model's."""
    quantized_weights: str = "auto"
    """A GGUF file's quantized weights: "widen" dequantizes them to ``dtype`` for every row;
    "native" also keeps the Q4_1 / Q8_0 blocks, which generated tokens' and logits rows read
    as stored (``kernels/cpu_qgemv.py``; other types stay widened, logged at load); "auto":
    native in bf16 (where it measured faster: ``bench/bench_quantized.py``) and in the
    float32 that ``dtype="auto"`` picks on a CPU without bf16 (Skylake-SP, Cascade Lake: a
    decode step 6x faster there, bench/log/2026-11.md), widen in a float32 asked for by name, the
    exactness reference, whose rows then keep the dense reference's sums. On a GPU every
    setting widens (the kernel is a CPU one)."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """LoRA adapters to serve beside the base model, as (name, folder) pairs: PEFT's saved
    adapters (``engine/lora.py``); a request names one by its name."""
    max_lora_adapters: int = 16
    """The most LoRA adapters (distinct files) served at once, loaded at start and at runtime;
    a runtime load beyond it is refused (unload one first). Each costs its factors' memory,
    and up to ``engine/lora.py:BANK_MAX_ADAPTERS`` loaded each costs every step with an
    adapter's rows time (beyond, a step pays for the adapters its rows take)."""
    max_lora_rank: int = 0
    """The largest rank of an adapter's factors served (vLLM's ``--max-lora-rank``): one
    above it is refused at start or at a runtime load. 0: any rank."""

    def __post_init__(self) -> None:
        if self.max_lora_rank < 0:
            raise InvalidRequestError("max_lora_rank must be >= 0", param="max_lora_rank")
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {DTYPES}", param="dtype")
        if self.quantized_weights not in QUANTIZED_WEIGHTS:
            raise InvalidRequestError(
                f"quantized_weights must be one of {QUANTIZED_WEIGHTS}", param="quantized_weights"
            )
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names) or not all(
            name and len(name) <= MAX_ADAPTER_NAME_CHARS for name in names
        ):
            raise InvalidRequestError(
                "lora_modules' names must be distinct, non-empty and at most "
                f"{MAX_ADAPTER_NAME_CHARS} characters",
                param="lora_modules",
            )
        if self.max_lora_adapters < 1:
            raise InvalidRequestError(
                "max_lora_adapters must be at least 1", param="max_lora_adapters"
            )
        if len(self.lora_modules) > self.max_lora_adapters:
            raise InvalidRequestError(
                f"{len(self.lora_modules)} lora_modules are more than max_lora_adapters "
                f"({self.max_lora_adapters})",
                param="lora_modules",
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequestError("max_model_len must be at least 2", param="max_model_len")


@dataclass(frozen=True)
class CacheConfig:
    """Size and behaviour of the paged KV cache."""

    block_size: int = 16
    """Tokens per KV block."""
    num_blocks: int | None = None
    """Number of KV blocks; when None it is derived from ``kv_cache_gib``."""
    kv_cache_gib: float = 1.0
    """KV cache size in GiB, used when ``num_blocks`` is None."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks shared with earlier prompts."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError("block_size must be a power of two", param="block_size")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise InvalidRequestError("num_blocks must be positive", param="num_blocks")
        if self.kv_cache_gib <= 0:
            raise InvalidRequestError("kv_cache_gib must be positive", param="kv_cache_gib")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step token budget and concurrency."""

    max_num_batched_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS
    """Token budget of one step: decode tokens plus prefill chunk tokens."""
    max_num_seqs: int = 256
    """Most requests in the running batch."""
    max_loras: int = 0
    """Most distinct LoRA adapters among the running requests (vLLM's ``--max-loras``): a
    request of another adapter waits, before its prompt or, its KV pushed by a prefill
    worker, after it, until one of those adapters' requests have all finished. 0: no bound."""

    def __post_init__(self) -> None:
        if self.max_loras < 0:
            raise InvalidRequestError("max_loras must be >= 0", param="max_loras")
        if self.max_num_batched_tokens <= 0:
            raise InvalidRequestError(
                "max_num_batched_tokens must be positive", param="max_num_batched_tokens"
            )
        if self.max_num_seqs <= 0:
            raise InvalidRequestError("max_num_seqs must be positive", param="max_num_seqs")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding by prompt lookup (``engine/ngram_proposer.py``): a decoding
    request whose context's suffix occurred before gets the tokens that followed it as a
    draft, verified in the same step (each draft token one more row, taking the decode row
    path). Requests without logprobs or stop strings only; their output is token for token
    the plain path's (greedy, and seeded sampling: each row draws the noise plain decoding
    would have drawn there; unseeded sampling follows the same distribution)."""

    num_tokens: int = 0
    """Draft tokens per request and step; 0 turns speculation off."""
    ngram_min: int = 2
    """Shortest context suffix looked up."""
    ngram_max: int = 4
    """Longest context suffix looked up (tried first)."""
    max_step_rows: int = 16
    """Drafts stop once a step's decode rows (one per decoding request, plus drafts) reach
    this: past a few rows a CPU decode step stops being bound by reading the weights, and a
    draft then costs what it may save."""

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            raise InvalidRequestError("speculative num_tokens must be >= 0", param="num_tokens")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidRequestError(
                "speculative n-gram sizes must satisfy 1 <= ngram_min <= ngram_max",
                param="ngram_min",
            )
        if self.max_step_rows <= 0:
            raise InvalidRequestError("max_step_rows must be positive", param="max_step_rows")


@dataclass(frozen=True)
class RunnerConfig:
    """How the model runs on this process."""

    num_threads: int | None = None
    """torch intra-op threads; None leaves torch's default."""
    attention_backend: str = "auto"
    """"torch" (reference), "cpu" (C++ CPU kernels), "triton" (CUDA) or "auto" (triton on
    CUDA, cpu for bf16 on CPU, torch otherwise)."""
    device: str = "cpu"
    """torch device of weights and KV cache."""
    decodes: bool = True
    """Whether this engine generates tokens past a prompt's first (False on a prefill-only
    worker: its projections then keep no copy of their weights for the decode GEMV, which
    only generated tokens' rows take; a decode step run anyway is correct, through oneDNN)."""
    engine: str = "model"
    """"model" runs the model; "sim" simulates it (``engine/sim_runner.py``): every step
    waits out the time ``sim_profile`` predicts for it and emits set tokens, with the real
    scheduler, block pool and KV transfer around it; no weights are loaded."""
    sim_profile: str = "default"
    """A simulated engine's step-time profile: a file ``engine/sim_calibrate.py`` wrote, or
    "default" (the one shipped: ``engine/sim_profile.py``)."""
    record_steps: str | None = None
    """A directory where the engine logs every step's shape and time
    (``sim_profile.StepLog``), to fit a simulation profile to a serving worker's steps."""
    cuda_graphs: bool = True
    """On CUDA with the Triton backend, decode-only steps replay CUDA graphs captured at start
    per batch-size bucket (``engine/decode_graphs.py``); False runs every step eagerly."""
    cuda_graph_max_rows: int = 256
    """The largest decode step captured (also capped by ``max_num_seqs`` rows and their
    drafts); larger steps run eagerly."""
    steps_ahead: bool = True
    """Where decode steps replay CUDA graphs, launch the next plain decode step before the
    host reads the current one's tokens (``EngineCore.steps_ahead``); False reads every
    step's tokens before planning the next."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise InvalidRequestError(f"engine must be one of {ENGINES}", param="engine")
        if self.cuda_graph_max_rows < 1:
            raise InvalidRequestError(
                "cuda_graph_max_rows must be positive", param="cuda_graph_max_rows"
            )
        if self.num_threads is not None and self.num_threads <= 0:
            raise InvalidRequestError("num_threads must be positive", param="num_threads")
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise InvalidRequestError(
                "attention_backend must be auto, torch, cpu or triton", param="attention_backend"
            )


@dataclass(frozen=True)
class EngineConfig:
    """Root configuration of one engine (one worker's model, cache, scheduler, runner)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
