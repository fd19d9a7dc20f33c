"""One worker's engine: a synchronous loop of schedule -> execute -> update.

``EngineCore`` owns the model runner, the KV cache manager and the scheduler. It works on token
ids only (text lives with the caller's detokenizer) and is driven by one thread: callers either
call ``step()`` themselves (offline, tests) or use ``AsyncEngine`` (``async_engine.py``), which
runs it off the asyncio event loop.

Invariant: when ``has_unfinished`` is False, every KV block is back in the pool.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from splitserve.common.adapter_id import AdapterId
from splitserve.common.bad_words import bad_word_sequences
from splitserve.common.blocks import BlockHash
from splitserve.common.busy_share import DecayingShare
from splitserve.common.cpu_info import cpu_name
from splitserve.common.errors import InvalidRequestError, ModelNotFoundError
from splitserve.common.grammar import GrammarCompiler, GrammarSpec
from splitserve.common.load import EngineLoad
from splitserve.common.logprobs import TokenLogprob
from splitserve.common.prompt import check_in_vocab
from splitserve.common.request_update import StepOutput
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.step_cost import StepCostLearner
from splitserve.engine.checkpoint import LoadedCheckpoint, describe_checkpoint, load_checkpoint
from splitserve.engine.config import EngineConfig
from splitserve.engine.decode_graphs import CudaGraphCapture, GraphCapture
from splitserve.engine.device import resolve_dtype
from splitserve.engine.engine_face import (
    CompletedPrompt,
    EngineFacts,
    LayerHook,
    PagedKv,
    PulledKv,
    ReservedBlocks,
)
from splitserve.engine.engine_report import AdapterRequests, SchedulerStats, StepTiming
from splitserve.engine.grammar_matchers import GrammarMatchers
from splitserve.engine.host_memory import return_freed_heap
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.launched_step import LaunchedDecode
from splitserve.engine.lora import (
    LoraAdapter,
    PreparedLayout,
    adapter_digest,
    check_rank,
    config_rank,
    load_lora_adapter,
    read_adapter_config,
)
from splitserve.engine.model import LlamaModel
from splitserve.engine.model_runner import ModelRunner, RunnerOutput, kv_cache_bytes_per_block
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.scheduler import Scheduler, SchedulerOutput
from splitserve.engine.sim_profile import StepLog, load_profile
from splitserve.engine.sim_runner import SimulatedRunner, word_token_ids
from splitserve.kernels.attention import AttentionBackend, TorchAttentionBackend
from splitserve.kernels.cpu_build import kernel_levels_line

logger = logging.getLogger(__name__)


class EngineCore:
    """Loads the model and runs requests to completion on one device."""

    def __init__(self, config: EngineConfig, checkpoint: LoadedCheckpoint | None = None) -> None:
        self.config = config
        if config.runner.num_threads is not None:
            torch.set_num_threads(config.runner.num_threads)
        device = torch.device(config.runner.device)
        simulated = config.runner.engine == "sim"
        self.dtype = resolve_dtype(config.model.dtype, device, computes=not simulated)
        native_quantized = _native_quantized(config, device, self.dtype)
        if checkpoint is None:
            checkpoint = self._read_checkpoint(simulated, native_quantized, device)
        self.checkpoint = replace(checkpoint, weights={}, quantized={})
        """The checkpoint's config and tokenizer; the loader's weights and blocks are dropped
        once the model holds its own copies."""
        self.model_config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.max_model_len = self.model_config.max_position_embeddings
        if config.model.max_model_len is not None:
            self.max_model_len = min(self.max_model_len, config.model.max_model_len)
        self.num_blocks = self._num_blocks()
        self.steps_ahead = config.runner.steps_ahead
        """Launch the decode step after a replayed one before reading the replayed one's
        tokens (``step``; ``Scheduler.schedule_ahead``), so the host's part of a step runs
        while the device computes the next. Only steps a captured graph replays and whose
        tokens the sampler chooses on the device alone (``decided_on_device``) go ahead; off
        CUDA graphs nothing does."""
        self._ahead: tuple[SchedulerOutput, LaunchedDecode] | None = None
        """The decode step launched ahead by the last ``step``, which the next one reads."""
        self.steps_launched_ahead = 0
        """Decode steps launched before the step before them was read (``_launch_ahead``)."""
        self._prompt_logprobs: dict[str, list[TokenLogprob]] = {}
        """Prompt logprobs of requests still computing their prompt, by request id
        (``ScheduledChunk.num_prompt_logprobs``): delivered with the first token."""
        self.graph_capture_error: str | None = None
        """Why the decode CUDA graphs failed to capture (the engine then runs every step
        eagerly, ``_capture_decode_graphs``); None where they were captured or not asked."""
        self.runner: ModelRunner | SimulatedRunner = self._make_runner(
            checkpoint, device, native_quantized
        )
        self._device = device
        self._banked: dict[str, LoraAdapter] = {}
        """The loaded adapters whose factors the model's bank holds, by digest: those served
        and those unloaded while requests of theirs still run (``_retire_adapters``)."""
        self._adapters_retiring = False
        """The bank holds an adapter no longer served, for requests of it still here."""
        self.defer_layouts = False
        """Whether a layout change the engine must make on its own (an adapter retired) is
        left to ``prepare_layout`` off the engine thread and ``install_layout`` (set by
        ``AsyncEngine``); else it is built at once, on the engine thread."""
        self.layout_stale = False
        """The model's adapter layout holds adapters ``_banked`` no longer does (retired,
        awaiting ``install_layout``); a layout with more adapters than needed serves the
        same requests (their rows never take the extra ones)."""
        self.adapters: dict[str, AdapterId] = self._load_adapters()
        """The LoRA adapters served, by name: ``ModelConfig.lora_modules``, then as loaded
        and unloaded at runtime (``serve_adapter``, ``unserve_adapter``). Replaced, never
        changed in place, so other threads read a whole one (``served_adapters``)."""
        del checkpoint  # the loader's weights and blocks: the model packed its own copies
        return_freed_heap()
        self._capture_decode_graphs(device)
        self.kv_cache = KVCacheManager(
            self.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            config.scheduler, self.kv_cache, self.max_model_len, config.speculative
        )
        self.facts = EngineFacts(
            model_name=self.model_config.name,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            num_blocks=self.num_blocks,
            kv_link=self.runner.link_model() if isinstance(self.runner, SimulatedRunner) else None,
            adapters=tuple(self.adapters.values()),
        )
        self.paged_kv = PagedKv(self.runner)
        """The KV cache for KV transfer (``engine_face.py``: its threading contract)."""
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.runner.grammars = self._grammar_matchers()
        self.step_cost = StepCostLearner()
        """This engine's step times, learned from every step (``load().step_cost``)."""
        self.last_step = StepTiming(0.0, 0.0)
        """The latest step's timing (engine thread)."""
        self.step_log: StepLog | None = self._step_log()
        """Every step's shape and time, where ``config.runner.record_steps`` asks for it."""
        self.prefill_share = DecayingShare(started_at=time.monotonic())
        """The share of recent wall time its steps spent on prompt tokens."""
        self._log_ready(device, simulated)

    def _read_checkpoint(
        self, simulated: bool, native_quantized: bool, device: torch.device
    ) -> LoadedCheckpoint:
        """The configured model's checkpoint: its config and tokenizer only for a simulated
        engine, else its weights too, in ``self.dtype`` (``native_quantized``: quantized
        blocks kept as they are; a random model's drawn on ``device``)."""
        model = self.config.model.model
        if simulated:
            return describe_checkpoint(model)
        return load_checkpoint(model, self.dtype, native_quantized, device)

    def _make_runner(
        self, checkpoint: LoadedCheckpoint, device: torch.device, native_quantized: bool
    ) -> ModelRunner | SimulatedRunner:
        """The step runner: simulated step times for ``engine == "sim"`` (the checkpoint's
        config and tokenizer only), else the model over the checkpoint's weights on
        ``device`` (packing its own copies; ``native_quantized``: its quantized blocks as
        they are) with its attention backend (``_backend``)."""
        config = self.config
        if config.runner.engine == "sim":
            return SimulatedRunner(
                load_profile(config.runner.sim_profile),
                word_token_ids(self.tokenizer),
                self.model_config.num_hidden_layers,
                self.num_blocks,
                config.cache.block_size,
            )
        model = LlamaModel(
            checkpoint.config,
            checkpoint.weights,
            self.dtype,
            device,
            self.max_model_len,
            decode_gemv=config.runner.decodes,
            quantized=checkpoint.quantized if native_quantized else None,
            fused_float32=serving_dtype(config, self.dtype),
        )
        backend = _backend(config, self.dtype, self.num_blocks)
        return ModelRunner(model, self.num_blocks, config.cache.block_size, backend)

    def _load_adapters(self) -> dict[str, AdapterId]:
        """Load ``config.model.lora_modules`` into the model (``read_adapter``); their ids by
        name. ``ModelLoadError`` for an adapter that cannot be served as trained."""
        adapters: dict[str, AdapterId] = {}
        for name, path in self.config.model.lora_modules:
            adapter = self.read_adapter(name, Path(path))
            if isinstance(adapter, LoraAdapter):
                self._banked.setdefault(adapter.digest, adapter)
            adapters[name] = AdapterId(name, adapter.digest)
            logger.info("LoRA adapter %r served from %s", name, path)
        self._bank_adapters()
        return adapters

    # ---- LoRA adapters at runtime ----------------------------------------------------------

    def read_adapter(self, name: str, folder: Path) -> LoraAdapter | AdapterId:
        """The adapter saved in ``folder``, read for this engine as ``name``: its factors in
        the model's dtype on its device, or for a simulated engine (which computes no terms)
        its checked config's id. ``ModelLoadError`` for one that cannot be served as
        trained. Touches no engine state: any thread (``AsyncEngine.load_adapter`` reads
        off the engine thread)."""
        max_rank = self.config.model.max_lora_rank
        if isinstance(self.runner, ModelRunner):
            return load_lora_adapter(
                name, folder, self.model_config, self.dtype, self._device, max_rank
            )
        check_rank(folder, config_rank(read_adapter_config(folder)), max_rank)
        return AdapterId(name, adapter_digest(folder))

    def serve_adapter(
        self,
        name: str,
        adapter: LoraAdapter | AdapterId,
        *,
        replace: bool = False,
        check_only: bool = False,
        prepared: PreparedLayout | None = None,
    ) -> bool:
        """Serve ``adapter`` (``read_adapter``'s) under ``name`` from the next step on; False
        where that name already serves these very files (nothing changes). Where it serves
        other files: with ``replace``, these take their place for the requests that come
        next (those running keep the old files to their end, ``_retire_adapters``), else
        ``InvalidRequestError`` (requests under one name must not meet two adapters by
        accident). ``InvalidRequestError`` too where these would be one more than
        ``ModelConfig.max_lora_adapters``. ``check_only``: the same answer and refusals,
        nothing changed. ``prepared``: the layout with it, built off the engine thread
        (``prepare_layout``), taken where it still holds exactly the adapters banked then.
        Engine thread."""
        digest = adapter.digest
        served = self.adapters.get(name)
        if served is not None and served.digest == digest:
            return False
        if served is not None and not replace:
            raise InvalidRequestError(
                f"a LoRA adapter named {name!r} is loaded here with other files: unload it "
                "first, load these under another name, or load them in place (load_inplace)",
                "lora_name",
            )
        kept = self._served_digests(besides=name)
        limit = self.config.model.max_lora_adapters
        if digest not in kept and len(kept) >= limit:
            raise InvalidRequestError(
                f"this worker serves {limit} LoRA adapters, its most (--max-lora-adapters): "
                "unload one first",
                "lora_name",
            )
        if check_only:
            return True
        if isinstance(adapter, LoraAdapter) and digest not in self._banked:
            self._banked[digest] = adapter
            self._bank_adapters(prepared)
        self.adapters = {**self.adapters, name: AdapterId(name, digest)}
        if served is None:
            logger.info("LoRA adapter %r loaded (digest %s)", name, digest)
        else:
            logger.info(
                "LoRA adapter %r replaced in place (digest %s, was %s)", name, digest, served.digest
            )
            self._retire_adapters()
        return True

    def unserve_adapter(self, name: str) -> None:
        """Stop serving the adapter ``name``: requests naming it are refused from now on
        (``ModelNotFoundError``, also where it was not served); its requests already
        running finish with it, and its factors leave the bank once the last has ended
        (``_retire_adapters``). Engine thread."""
        self.adapter_digest(name)  # ModelNotFoundError where not served
        self.adapters = {key: value for key, value in self.adapters.items() if key != name}
        logger.info("LoRA adapter %r unloaded", name)
        self._retire_adapters()

    def adapter_digest(self, name: str) -> str:
        """The digest of the files served under ``name`` ("" for "", the base model);
        ``ModelNotFoundError`` where no adapter of that name is served."""
        if not name:
            return ""
        served = self.adapters.get(name)
        if served is None:
            raise ModelNotFoundError(
                f"The model `{name}` does not exist: no LoRA adapter of that name is loaded "
                f"here (loaded: {', '.join(self.adapters) or 'none'})"
            )
        return served.digest

    def _served_digests(self, besides: str = "") -> set[str]:
        """The digests of the adapters served (several names may serve one), under another
        name than ``besides``."""
        return {adapter.digest for other, adapter in self.adapters.items() if other != besides}

    def _retire_adapters(self) -> None:
        """Drop from the bank the adapters no longer served that no request here takes any
        more (a request keeps its adapter to its end: ``Request.adapter_digest``)."""
        retired = set(self._banked) - self._served_digests()
        taken = {request.adapter_digest for request in self.scheduler.requests.values()}
        gone = retired - taken
        self._adapters_retiring = bool(retired - gone)
        if gone:
            for digest in gone:
                del self._banked[digest]
            if self.defer_layouts and isinstance(self.runner, ModelRunner):
                self.layout_stale = True  # AsyncEngine lays them out again off this thread
            else:
                self._bank_adapters()

    def _bank_adapters(self, prepared: PreparedLayout | None = None) -> None:
        """Lay the banked adapters' factors out for the model's steps
        (``engine/lora.py:adapter_layout``): ``prepared``'s where it holds exactly them."""
        if not isinstance(self.runner, ModelRunner):
            return
        if prepared is not None and prepared.digests == tuple(self._banked):
            self.runner.model.adapters = prepared.layout
        else:
            self.runner.model.set_adapters(list(self._banked.values()))
        self.layout_stale = False

    def prepare_layout(
        self, adding: LoraAdapter | AdapterId | None = None
    ) -> PreparedLayout | None:
        """The layout of the adapters banked now, with ``adding`` (``read_adapter``'s), for
        ``serve_adapter`` or ``install_layout`` to take on the engine thread: built here, on
        any thread, while the engine steps on (reusing the current layout's products where
        ``adapter_layout`` does). None where there is nothing to build: a simulated engine,
        or ``adding`` banked already."""
        if not isinstance(self.runner, ModelRunner) or isinstance(adding, AdapterId):
            return None
        banked = self._banked.copy()  # one call: whole under the GIL
        if adding is not None:
            if adding.digest in banked:
                return None
            banked[adding.digest] = adding
        layout = self.runner.model.layout_for(list(banked.values()))
        return PreparedLayout(tuple(banked), layout)

    def install_layout(self, prepared: PreparedLayout) -> bool:
        """Take ``prepared`` (``prepare_layout``'s) where it holds exactly the adapters banked
        now; whether it did (else the layout stays as it was, stale or not). Engine
        thread."""
        if prepared.digests != tuple(self._banked):
            return False
        self._bank_adapters(prepared)
        return True

    def _capture_decode_graphs(self, device: torch.device) -> None:
        """Capture the decode steps' CUDA graphs (``engine/decode_graphs.py``) where
        ``config.runner.cuda_graphs`` asks and they apply: a model on CUDA whose attention
        backend captures graphs, in an engine that decodes (not a prefill-only one). Steps of
        up to ``cuda_graph_max_rows`` rows, and no more than ``max_num_seqs`` requests with
        their drafts make. A capture that fails is logged with its traceback and kept in
        ``graph_capture_error``, and the engine serves with every step eager: slower, never
        down (a GPU whose driver or library refuses a capture still serves)."""
        runner, config = self.runner, self.config
        if not (
            config.runner.cuda_graphs
            and config.runner.decodes
            and device.type == "cuda"
            and isinstance(runner, ModelRunner)
            and runner.backend.captures_graphs
        ):
            return
        max_rows = min(
            config.runner.cuda_graph_max_rows,
            config.scheduler.max_num_seqs * (1 + config.speculative.num_tokens),
        )
        self._capture_or_serve_eagerly(max_rows, CudaGraphCapture(device))

    def _capture_or_serve_eagerly(self, max_rows: int, capture: GraphCapture) -> None:
        """Capture the runner's decode steps of up to ``max_rows`` rows with ``capture``; on
        any failure, log it with its traceback, keep it in ``graph_capture_error`` and leave
        every step eager (``runner.decode_graphs`` None: no graph of a failed capture is
        replayed, not even the buckets captured before it failed)."""
        runner = self.runner
        assert isinstance(runner, ModelRunner)
        try:
            graphs = runner.capture_decode_graphs(max_rows, self.max_model_len, capture)
        except Exception as error:  # noqa: BLE001 - any failure: serve, eagerly, and say so
            runner.decode_graphs = None
            self.graph_capture_error = f"{type(error).__name__}: {error}"
            logger.exception(
                "decode CUDA graphs failed to capture; every step runs eagerly "
                "(--no-cuda-graphs skips the capture)"
            )
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)  # a fault that broke the device shows here
            return
        logger.info(
            "decode CUDA graphs: %d buckets of 1-%d rows, captured in %.1f s",
            len(graphs.buckets),
            max_rows,
            graphs.capture_s,
        )

    def _grammar_matchers(self) -> GrammarMatchers:
        """The runner's matchers of constrained requests (their tokenizer is built when a
        constrained request first arrives, ``prepare_grammar``)."""
        return GrammarMatchers(
            GrammarCompiler(
                self.tokenizer,
                self.model_config.vocab_size,
                sorted(self.eos_token_ids),
            ),
            self.model_config.vocab_size,
        )

    def _step_log(self) -> StepLog | None:
        """A log of every step's shape and time in ``config.runner.record_steps`` (its header
        names the model, dtype, threads, CPU and engine), or None where not asked for."""
        runner = self.config.runner
        if runner.record_steps is None:
            return None
        header = {
            "model": self.model_config.name,
            "dtype": str(self.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
            "cpu": cpu_name(),
            "engine": runner.engine,
            "kv_bytes_per_token": self.model_config.kv_bytes_per_token(self.dtype.itemsize),
        }
        return StepLog(runner.record_steps, header)

    def _log_ready(self, device: torch.device, simulated: bool) -> None:
        """Log what the engine serves, and on a CPU which level each loaded kernel runs."""
        config = self.config
        logger.info(
            "engine ready: %s%s dtype=%s blocks=%d x %d tokens, max_model_len=%d",
            self.model_config.name,
            f" (simulated: step times of {config.runner.sim_profile})" if simulated else "",
            self.dtype,
            self.num_blocks,
            config.cache.block_size,
            self.max_model_len,
        )
        if device.type == "cpu" and not simulated:
            logger.info("%s", kernel_levels_line())  # which level each loaded kernel runs

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        cfg = self.model_config
        per_block = kv_cache_bytes_per_block(
            cfg.num_hidden_layers,
            cache.block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            self.dtype,
        )
        return max(1, int(cache.kv_cache_gib * (1 << 30)) // per_block)

    # ---- requests --------------------------------------------------------------------------

    def validate_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` if this request could never be served
        (``ModelNotFoundError`` for a LoRA adapter not loaded here); changes nothing."""
        vocab = self.model_config.vocab_size
        if any(not (isinstance(t, int) and not isinstance(t, bool)) for t in prompt_token_ids):
            raise InvalidRequestError("prompt token ids must be integers", "prompt")
        check_in_vocab(prompt_token_ids, vocab, "prompt token ids", "prompt")
        params.check_vocab(vocab)
        self.adapter_digest(params.adapter)  # ModelNotFoundError for one not served
        self.scheduler.check_fits(len(prompt_token_ids), params)

    def prepare_grammar(self, spec: GrammarSpec) -> None:
        """Build the matchers' tokenizer (once) and compile ``spec`` (cached), so that the
        request's first step only makes its matcher; raises ``InvalidRequestError`` for a
        constraint that does not compile. Thread-safe: ``AsyncEngine.submit`` calls it on a
        worker thread."""
        assert self.runner.grammars is not None
        self.runner.grammars.compiler.compile(spec)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prior_output_token_ids: Sequence[int] = (),
    ) -> None:
        """Queue a request; raises ``InvalidRequestError`` for input it can never serve.

        ``prior_output_token_ids``: a resumed request's tokens generated before (elsewhere):
        computed with the prompt, counted by ``max_tokens``, ``min_tokens`` and the penalties
        as output, and skipped in a seeded request's random stream (``ModelRunner``), so the
        request goes on exactly as if it had never moved."""
        request = self._new_request(request_id, prompt_token_ids, params)
        if prior_output_token_ids:
            self._check_prior_output(prior_output_token_ids, params)
            request.output_token_ids = list(prior_output_token_ids)
            request.all_token_ids.extend(prior_output_token_ids)
        self.scheduler.add_request(request)

    def _check_prior_output(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        check_in_vocab(token_ids, vocab, "prior output token ids", "prior_output_token_ids")
        if len(token_ids) >= params.max_tokens:
            raise InvalidRequestError(
                f"{len(token_ids)} prior output tokens leave nothing of max_tokens "
                f"{params.max_tokens}",
                "prior_output_token_ids",
            )

    def _new_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> Request:
        self.validate_request(prompt_token_ids, params)
        if params.bad_words and not params.bad_words_token_ids:
            sequences = bad_word_sequences(
                params.bad_words, lambda text: self.tokenizer.encode(text, False)
            )
            params = replace(params, bad_words_token_ids=sequences)
        return Request(
            request_id,
            list(prompt_token_ids),
            params,
            self.eos_token_ids,
            self.adapter_digest(params.adapter),
        )

    def abort_request(self, request_id: str) -> bool:
        """Abort and free a request; False if it was unknown or already finished."""
        self._prompt_logprobs.pop(request_id, None)
        return self.scheduler.abort_request(request_id) is not None

    def finish_request(self, request_id: str) -> None:
        """End a request as stopped (a stop string matched downstream) and free its blocks."""
        self._prompt_logprobs.pop(request_id, None)
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._ahead is not None

    @property
    def stats(self) -> SchedulerStats:
        """The scheduler's counters now (immutable: a new object after each change)."""
        return self.scheduler.stats

    def load(self) -> EngineLoad:
        """Current load figures; call on the thread that steps the engine."""
        scheduler = self.scheduler
        pending_prefill = sum(
            max(0, r.num_prompt_tokens - r.num_computed_tokens)
            for r in (*scheduler.waiting, *scheduler.running)
        )
        return EngineLoad(
            num_total_blocks=self.num_blocks,
            num_used_blocks=self.num_blocks - self.kv_cache.num_free_blocks,
            num_running_requests=len(scheduler.running),
            num_waiting_requests=len(scheduler.waiting) + len(scheduler.parked),
            num_reserved_requests=sum(
                r.status is RequestStatus.WAITING_FOR_REMOTE_KV for r in scheduler.requests.values()
            ),
            num_running_tokens=sum(r.num_tokens for r in scheduler.running),
            num_pending_prefill_tokens=pending_prefill,
            num_finished_requests=scheduler.stats.num_finished_requests,
            step_cost=self.step_cost.estimate(),
            prefill_share=self.prefill_share.share(time.monotonic()),
            prefill_chunk_tokens=self.config.scheduler.max_num_batched_tokens,
        )

    def lora_requests(self) -> tuple[AdapterRequests, ...]:
        """Each LoRA adapter served (or taken by a request still here) with its requests
        running and waiting (queued, parked), by the name requests use; () where none is
        served and none taken. Engine thread."""
        if not self.adapters and not self._banked:
            return ()
        counts = {name: [0, 0] for name in self.adapters}
        scheduler = self.scheduler
        for request in scheduler.running:
            if request.params.adapter:
                counts.setdefault(request.params.adapter, [0, 0])[0] += 1
        for request in (*scheduler.waiting, *scheduler.parked):
            if request.params.adapter:
                counts.setdefault(request.params.adapter, [0, 0])[1] += 1
        return tuple(
            AdapterRequests(name, running, waiting)
            for name, (running, waiting) in sorted(counts.items())
        )

    # ---- the step --------------------------------------------------------------------------

    def reserve_remote_prefill(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> Sequence[int]:
        """Reserve blocks for a prompt prefilled elsewhere; returns its block table.

        Raises ``InvalidRequestError`` for bad input and ``CapacityError`` when full now.
        """
        request = self.remote_prefill_request(request_id, prompt_token_ids, params)
        return self.reserve_request(request).block_ids

    def remote_prefill_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> Request:
        """A validated request whose prompt another worker prefills, for ``reserve_request``
        (validated once, however often it is offered). ``InvalidRequestError`` for bad input."""
        return self._new_request(request_id, prompt_token_ids, params)

    def check_reservable(self, request: Request) -> None:
        """Raise what ``reserve_request`` would for a request it can never take (a duplicate
        id, a prompt beyond the context or the pool); changes nothing."""
        self.scheduler.check_new(request)

    def has_room_for(self, request: Request) -> bool:
        """Whether the pool has enough free blocks now for the request's prompt (cheap)."""
        needed = self.kv_cache.blocks_needed(request.num_prompt_tokens)
        return needed <= self.kv_cache.num_free_blocks

    def reserve_request(self, request: Request) -> ReservedBlocks:
        """Reserve blocks for ``request`` (``remote_prefill_request``), its cached prefix
        first (``Scheduler.reserve_for_remote_prefill``). ``CapacityError`` (nothing held)
        when the pool cannot take it now."""
        table = self.scheduler.reserve_for_remote_prefill(request)
        block_size = self.scheduler.kv_cache.block_size
        return ReservedBlocks(tuple(table), request.num_computed_tokens // block_size)

    def complete_remote_prefill(
        self,
        request_id: str,
        first_token_id: int,
        first_logprob: TokenLogprob | None = None,
        num_cached_tokens: int = 0,
        prompt_logprobs: Sequence[TokenLogprob] = (),
    ) -> StepOutput:
        """The reserved request's KV has landed; it decodes from the next step on.
        ``num_cached_tokens``: prompt tokens the prefilling worker had in its prefix cache;
        ``prompt_logprobs``: the prompt's, computed there (delivered with the token).

        Raises ``InvalidRequestError``, changing nothing, for a token outside the vocabulary
        (it would fail the whole batch's embedding lookup)."""
        vocab = self.model_config.vocab_size
        if not 0 <= first_token_id < vocab:
            raise InvalidRequestError(
                f"first token id {first_token_id} is outside [0, {vocab})", "first_token_id"
            )
        update = self.scheduler.complete_remote_prefill(
            request_id, first_token_id, num_cached_tokens
        )
        return StepOutput(update, _logprobs_of(first_logprob), tuple(prompt_logprobs))

    def hold_blocks(self, block_ids: Sequence[int]) -> None:
        """Take one extra reference on each block: it stays out of the pool, whatever ends
        its request, until ``release_blocks`` gives the reference back."""
        self.kv_cache.pool.touch(block_ids)

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        """Give back references ``hold_blocks`` took; blocks with no other go to the pool."""
        self.kv_cache.pool.free(list(reversed(block_ids)))

    def adopt_pulled_kv(
        self, token_ids: Sequence[int], pulled: PulledKv, root: BlockHash | None = None
    ) -> int:
        """Enter KV another worker sent for the prompt ``token_ids`` (its blocks
        ``pulled.first_block ..``; its hashes chained from ``root``, the request's salt and
        adapter) into the prefix cache, after the prompt's blocks this engine holds: new blocks
        get the pulled KV this engine lacks and their prefix hashes, then go back to the pool
        as cached (freed last, so a request added in the same command finds them). Returns
        the blocks adopted: 0 when prefix caching is off, when this engine already holds them
        all, when it lacks blocks before ``first_block`` (the pulled KV would not follow a
        cached prefix: the prompt is computed instead), when the blocks would reach the
        prompt's last token, or when the pool is short now."""
        kv = self.kv_cache
        end = pulled.first_block + pulled.num_blocks
        if not kv.enable_prefix_caching or end * kv.block_size >= len(token_ids):
            return 0
        cached = kv.find_cached_prefix(token_ids, root)[:end]
        if len(cached) < pulled.first_block or len(cached) == end:
            return 0
        key = "\x00pulled"  # a table of its own for this command only (no request id has NUL)
        if not kv.allocate(key, end * kv.block_size, cached_blocks=cached):
            return 0
        new_blocks = kv.block_table(key)[len(cached) :]
        fresh = pulled.kv[:, :, len(cached) - pulled.first_block :]  # [layers, 2, new, ...]
        for layer in range(fresh.shape[0]):
            self.runner.write_kv_blocks(layer, new_blocks, fresh[layer])
        kv.cache_full_blocks(key, token_ids, end * kv.block_size, root)
        kv.free(key)
        return len(new_blocks)

    def has_request(self, request_id: str) -> bool:
        """True while the request is known here (waiting, running or reserved)."""
        return request_id in self.scheduler.requests

    def step(
        self,
        on_layer_kv_written: LayerHook | None = None,
        between_layers: Callable[[], None] | None = None,
    ) -> list[StepOutput]:
        """Schedule -> execute -> update; returns the progress of every request that sampled.

        With ``steps_ahead``, a replayed decode step is launched unread and the step after it
        launched behind it before this one's tokens are applied; the next call reads that one
        instead of scheduling (module docstring of ``engine/scheduler.py``: Steps ahead).
        Either way each call applies exactly one step.

        ``on_layer_kv_written(layer, completed)`` fires as each layer's KV is written, in
        steps that complete some prompt, with those prompts (their block tables say where
        the KV is). ``between_layers()`` fires between the layers of steps with prompt rows
        (``Model.forward``).
        """
        started = time.perf_counter()
        ran_ahead = self._ahead is not None
        if ran_ahead:  # launched by the step before (``_launch_ahead``)
            scheduled, launched = self._ahead
            self._ahead = None
        else:
            scheduled = self.scheduler.schedule()
            launched = self._launch(scheduled) if self.steps_ahead else None
        if launched is None:
            executed = self.runner.execute(
                scheduled, self._layer_hook(scheduled, on_layer_kv_written), between_layers
            )
        else:
            self._ahead = self._launch_ahead(scheduled, launched)
            executed = self._finish_launched(launched)
        updates = self.scheduler.update(
            scheduled, executed.sampled_token_ids, executed.verified_token_ids
        )
        shape, seconds = scheduled.shape(), time.perf_counter() - started
        estimate = self.step_cost.estimate()  # what the model said before this step taught it
        predicted_s = estimate.step_s(shape) if estimate.predicts(shape) else 0.0
        self.last_step = StepTiming(seconds, predicted_s, shape, ran_ahead)
        if self.step_log is not None:
            self.step_log.write(shape, seconds)
        prefill_s = self.step_cost.observe(shape, seconds)
        self.scheduler.step_cost = self.step_cost.estimate()  # weighs the next step's drafts
        self.prefill_share.observe(time.monotonic(), prefill_s)
        self._drop_idle_ahead()
        if self._adapters_retiring:  # an unloaded adapter's last requests may be done
            self._retire_adapters()
        for request_id, (first, records) in executed.prompt_logprobs.items():
            kept = self._prompt_logprobs.setdefault(request_id, [])
            kept[first - 1 :] = records  # a chunk computed again (after a preemption) replaces
        return [
            StepOutput(
                u,
                _logprobs_of(executed.logprobs.get(u.request_id)),
                tuple(self._prompt_logprobs.pop(u.request_id, ())),  # the prompt is done
            )
            for u in updates
        ]

    @staticmethod
    def _layer_hook(
        scheduled: SchedulerOutput, on_layer_kv_written: LayerHook | None
    ) -> Callable[[int], None] | None:
        """``on_layer_kv_written`` bound to the prompts ``scheduled`` completes; None where
        none is (only a KV-pushing worker passes a hook)."""
        if on_layer_kv_written is None:
            return None
        completed = [
            CompletedPrompt(chunk.request_id, chunk.block_table)
            for chunk in scheduled.chunks
            if chunk.completes_prompt
        ]
        if not completed:
            return None

        def hook(layer: int) -> None:
            on_layer_kv_written(layer, completed)

        return hook

    # ---- steps ahead (``steps_ahead``) ---------------------------------------------------------

    def _launch(
        self, scheduled: SchedulerOutput, after: LaunchedDecode | None = None
    ) -> LaunchedDecode | None:
        """``scheduled`` launched unread where the runner can (``launch_decode``), marked in
        flight with the scheduler; else None."""
        runner = self.runner
        if not isinstance(runner, ModelRunner):
            return None
        launched = runner.launch_decode(scheduled, after)
        if launched is not None:
            self.scheduler.launched(launched.serial, scheduled)
        return launched

    def _launch_ahead(
        self, scheduled: SchedulerOutput, launched: LaunchedDecode
    ) -> tuple[SchedulerOutput, LaunchedDecode] | None:
        """The step after ``launched``, planned and launched behind it before its tokens are
        read (``Scheduler.schedule_ahead``), for the next ``step`` to read; None where it
        cannot be."""
        if not self.steps_ahead:
            return None
        ahead = self.scheduler.schedule_ahead(scheduled)
        if ahead is None:
            return None
        next_launched = self._launch(ahead, after=launched)
        if next_launched is None:
            return None
        self.steps_launched_ahead += 1
        return ahead, next_launched

    def _finish_launched(self, launched: LaunchedDecode) -> RunnerOutput:
        """The launched step's tokens; its requests' ended blocks go back to the pool."""
        try:
            return ModelRunner.finish_decode(launched)
        finally:
            self.scheduler.settle(launched.serial)

    def _drop_idle_ahead(self) -> None:
        """A step launched ahead none of whose requests still runs (all ended with the step
        before it, or were aborted) is waited for and dropped now, so that an engine with
        nothing to do holds no block (module invariant)."""
        if self._ahead is None:
            return
        ahead, launched = self._ahead
        running = {request.request_id for request in self.scheduler.running}
        if any(chunk.request_id in running for chunk in ahead.chunks):
            return
        self._ahead = None
        self._finish_launched(launched)


def _logprobs_of(logprob: TokenLogprob | None) -> tuple[TokenLogprob, ...]:
    return () if logprob is None else (logprob,)


def serving_dtype(config: EngineConfig, dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a serving dtype rather than the float32 reference: bf16, or the
    float32 that ``dtype="auto"`` picks on a CPU without bf16. A serving dtype takes the CPU
    kernels whose sums differ from HF's in order only (the quantized rows under
    ``quantized_weights="auto"``, the C++ attention, the fused add + RMSNorm); a float32 named
    by ``dtype="float32"`` keeps HF's ops."""
    return dtype == torch.bfloat16 or config.model.dtype == "auto"


def _native_quantized(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the model keeps a quantized checkpoint's blocks as they are, for the CPU's
    quantized kernel: ``quantized_weights="native"``, or ``"auto"`` at a serving dtype
    (``serving_dtype``); never off the CPU."""
    return device.type == "cpu" and (  # the kernel is a CPU one
        config.model.quantized_weights == "native"
        or (config.model.quantized_weights == "auto" and serving_dtype(config, dtype))
    )


def _backend(config: EngineConfig, dtype: torch.dtype, num_blocks: int) -> AttentionBackend:
    """The attention backend ``config.runner.attention_backend`` names; "auto" picks Triton on
    CUDA (when installed), the C++ CPU kernel on CPU for bf16 and for the float32 that
    ``dtype="auto"`` picks on a CPU without bf16 (the serving dtype there; its decode rows are
    batch invariant and greedy output HF's, ``test_correctness_hf.test_cpu_decode_kernel``),
    and the torch reference backend otherwise (a float32 asked for by name: the reference,
    batch-invariant path that matches HF exactly)."""
    name = config.runner.attention_backend
    on_cuda = config.runner.device.startswith("cuda")
    batch_invariant = dtype == torch.float32
    if name == "triton" or (name == "auto" and on_cuda and importlib.util.find_spec("triton")):
        from splitserve.kernels.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(batch_invariant=batch_invariant)
    if name == "cpu" or (name == "auto" and not on_cuda and serving_dtype(config, dtype)):
        from splitserve.kernels.cpu_attention import (
            load_cpu_decode_attention,
            load_cpu_prefill_attention,
        )
        from splitserve.kernels.cpu_backend import CpuAttentionBackend

        if on_cuda:
            raise InvalidRequestError(
                "attention_backend cpu runs on the CPU only", param="attention_backend"
            )
        kernel = load_cpu_decode_attention()
        if kernel is not None and dtype in kernel.dtypes:
            return CpuAttentionBackend(kernel, num_blocks, load_cpu_prefill_attention())
        if name == "cpu":
            raise InvalidRequestError(
                f"attention_backend cpu is unavailable here for {dtype} (see the log)",
                param="attention_backend",
            )
    return TorchAttentionBackend(batch_invariant=batch_invariant)
