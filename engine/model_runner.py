"""Executes one scheduled step: packs the batch, runs the model over the paged KV cache, samples.

Contract: ``execute(SchedulerOutput) -> RunnerOutput`` with exactly one sampled token for every
chunk whose ``samples`` flag is set, and for a chunk with drafts one more for each draft (the
token sampled after each of its tokens, ``verified_token_ids``). Each token of a decode chunk
(``ScheduledChunk.is_decode``: a last sampled token and its drafts) is its own decode row: a
single-token sequence whose context ends at it, so a verified draft's logits are computed as
the plain decode step at its position would compute them. The runner owns the KV cache tensor
``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` and the per-request random
generators; it never decides which blocks a request uses (the scheduler's block tables do).
It is not thread-safe: one thread (the engine thread) calls it, never the asyncio loop.

Decode-only steps replay a CUDA graph of their batch-size bucket once ``capture_decode_graphs``
captured them (``engine/decode_graphs.py``); every other step, and any step ``DecodeGraphs.run``
turns down, runs eagerly. A replayed decode step whose tokens the sampler chooses on the
device alone may be launched without being read (``launch_decode``, ``finish_decode``;
``engine/launched_step.py``), and the step after it launched behind it with those tokens fed
on the device (``EngineCore.step``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from splitserve.common.blocks import blocks_for_tokens
from splitserve.common.logprobs import TokenLogprob
from splitserve.common.sampling_params import decided_on_device
from splitserve.engine.decode_graphs import (
    DecodeBatch,
    DecodeGraphs,
    GraphCapture,
    StaticDecodeInputs,
    graph_buckets,
)
from splitserve.engine.grammar_matchers import GrammarMatchers
from splitserve.engine.host_copies import to_device
from splitserve.engine.kv_blocks import KvBlockStore
from splitserve.engine.launched_step import LaunchedDecode
from splitserve.engine.lora import StepTerms
from splitserve.engine.model import GeneratedRows, LlamaModel
from splitserve.engine.sampler import Sampler, SamplingRow, advance, token_logprobs
from splitserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from splitserve.kernels.attention import AttentionBackend, SequenceSpan
from splitserve.kernels.cpu_sampling import CpuSampling, load_cpu_sampling


@dataclass(frozen=True)
class RunnerOutput:
    """Tokens sampled in one step, keyed by request id."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    """Chunks without drafts: the token sampled after the chunk's last token."""
    verified_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Chunks with drafts: the token sampled after each of the chunk's tokens."""
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    """Only for requests that asked for logprobs."""
    prompt_logprobs: dict[str, tuple[int, tuple[TokenLogprob, ...]]] = field(default_factory=dict)
    """Chunks computing prompt logprobs (``ScheduledChunk.num_prompt_logprobs``): the index
    of the first prompt token described, and one record per prompt token from it on."""


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block occupies across all layers, keys and values."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * element_size


class ModelRunner(KvBlockStore):
    """Runs ``LlamaModel`` steps over its own paged KV cache."""

    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        backend: AttentionBackend,
    ) -> None:
        cfg = model.config
        super().__init__(
            cfg.num_hidden_layers,
            num_blocks,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            model.dtype,
            model.device,
        )
        self.model = model
        self.backend = backend
        native = model.device.type == "cpu" and os.environ.get(NATIVE_SAMPLER_ENV, "1") != "0"
        self.sampler = Sampler(load_cpu_sampling() if native else None)
        self._generators: dict[str, torch.Generator] = {}
        self.grammars: GrammarMatchers | None = None
        """Constrained requests' matchers (set by the engine when it can build them)."""
        self.decode_graphs: DecodeGraphs | None = None
        """Captured decode steps (``capture_decode_graphs``); None runs every step eagerly."""
        self._launches = 0
        """Steps ``launch_decode`` launched (their serials)."""

    def capture_decode_graphs(
        self, max_rows: int, max_model_len: int, capture: GraphCapture
    ) -> DecodeGraphs:
        """Capture the decode steps of up to ``max_rows`` rows (``graph_buckets``) with
        contexts of up to ``max_model_len`` tokens, and replay them from now on. Needs a
        backend that ``captures_graphs``; ``capture`` is ``CudaGraphCapture`` on CUDA
        (``record_step`` off it, for tests). Writes nothing into the KV cache."""
        if not self.backend.captures_graphs:
            raise ValueError(f"the {self.backend.name} attention backend captures no graphs")
        inputs = StaticDecodeInputs(
            max_rows, blocks_for_tokens(max_model_len, self.block_size), self.block_size,
            self.device,
        )  # fmt: skip

        def forward(bucket: int) -> torch.Tensor:  # [bucket, vocab] float32
            metadata = self.backend.graph_decode_metadata(
                inputs.slot_mapping[:bucket],
                inputs.block_tables[:bucket],
                inputs.seq_lens[:bucket],
                self.block_size,
            )
            return self.model.forward(
                inputs.token_ids[:bucket],
                inputs.positions[:bucket],
                self.kv_cache,
                self.backend,
                metadata,
                inputs.logits_rows[:bucket],
                generated=GeneratedRows(tokens=bucket, samples=bucket),
            )

        self.decode_graphs = DecodeGraphs(forward, inputs, graph_buckets(max_rows), capture)
        return self.decode_graphs

    def execute(
        self,
        step: SchedulerOutput,
        on_layer_kv_written: Callable[[int], None] | None = None,
        between_layers: Callable[[], None] | None = None,
    ) -> RunnerOutput:
        """Run one step: write every chunk's KV, sample one token per sampling chunk.

        ``on_layer_kv_written(layer)`` fires once per layer as soon as its KV is written;
        ``between_layers()`` between the layers of a step with prompt rows (``Model.forward``).
        """
        self._drop_finished(step)
        if not step.chunks:
            return RunnerOutput()
        # Decode rows first (the attention backend batches single-token sequences as decodes),
        # among them generated tokens first (the projections' GEMV takes exactly those rows).
        chunks = sorted(
            step.chunks, key=lambda chunk: (not _decode_rows(chunk), not chunk.is_decode)
        )
        sampling_chunks = [chunk for chunk in chunks if chunk.samples]
        logits = self._forward(chunks, on_layer_kv_written, between_layers)  # [rows, vocab]
        # logits: [samples, vocab] from here
        prompt_logprobs, logits = _prompt_logprobs(chunks, logits, self.sampler.kernels)
        if not sampling_chunks:
            return RunnerOutput(prompt_logprobs=prompt_logprobs)
        return dataclasses.replace(
            self._sample(sampling_chunks, logits), prompt_logprobs=prompt_logprobs
        )

    def _drop_finished(self, step: SchedulerOutput) -> None:
        """Forget the per-request state of the requests that ended before ``step``."""
        for request_id in step.finished_request_ids:
            self._generators.pop(request_id, None)
            if self.grammars is not None:
                self.grammars.free(request_id)

    def launch_decode(
        self, step: SchedulerOutput, after: LaunchedDecode | None = None
    ) -> LaunchedDecode | None:
        """Launch ``step`` without reading its tokens (``engine/launched_step.py``), where it
        is a decode step whose every row's token the sampler chooses on the device alone
        (``decided_on_device``; ``Sampler.choose`` with ``wait_free``, the tokens ``execute``
        would sample) and a captured graph replays it; else None, nothing launched
        (``execute`` runs it).
        ``finish_decode`` reads the tokens. ``after``: the launched step whose tokens are the
        inputs of this step's leading rows (``step`` from ``Scheduler.schedule_ahead``: those
        rows' requests are some of ``after``'s, their token ids placeholders; the rows after
        them, requests that joined since, carry their own tokens); they are fed on the device,
        in this step's row order."""
        graphs = self.decode_graphs
        if graphs is None or not step.chunks:
            return None
        rows_of = {} if after is None else after.row_of
        if not all(
            chunk.num_tokens == 1
            and not chunk.adapter  # graphs hold no adapter's terms
            and chunk.is_decode
            and chunk.samples
            and decided_on_device(chunk.params)
            for chunk in step.chunks
        ):
            return None
        chunks = step.chunks  # all decode rows: ``execute``'s order is theirs
        input_ids, positions, logits_rows = self._pack(list(chunks))
        spans = [span for chunk in chunks for span in _spans(chunk)]
        batch = DecodeBatch(input_ids, positions, spans, logits_rows)
        bucket = graphs.bucket_of(batch)
        if bucket is None:
            return None  # ``execute`` runs it (and counts it as eager)
        feed = None  # [fed rows] int64 on the device: the leading rows' tokens, from ``after``
        if after is not None:
            rows = [rows_of[chunk.request_id] for chunk in chunks if chunk.request_id in rows_of]
            if any(chunk.request_id not in rows_of for chunk in chunks[: len(rows)]):
                raise ValueError("the rows fed from the step before must lead the step")
            feed = after.token_ids
            if rows != list(range(len(after.chunks))):
                feed = feed[to_device(rows, torch.int64, self.device)]
        logits = graphs.replay(batch, bucket, feed)
        self._drop_finished(step)
        sampling_rows = [  # seeded: its generator; a fed row: after's token not read yet
            dataclasses.replace(self._sampling_row(chunk), pending_outputs=1)
            if chunk.request_id in rows_of
            else self._sampling_row(chunk)
            for chunk in chunks
        ]
        token_ids = self.sampler.choose(logits, sampling_rows, wait_free=True)  # [rows] int64
        ready = None
        if self.device.type == "cuda":  # pinned, so the copy waits for nothing on the host
            host_token_ids = torch.empty(token_ids.shape, dtype=torch.int64, pin_memory=True)
            host_token_ids.copy_(token_ids, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host_token_ids = token_ids.clone()
        self._launches += 1
        return LaunchedDecode(self._launches, tuple(chunks), token_ids, host_token_ids, ready)

    @staticmethod
    def finish_decode(launched: LaunchedDecode) -> RunnerOutput:
        """The tokens of a ``launch_decode`` step, once the device has made them."""
        tokens = launched.wait()
        return RunnerOutput(
            sampled_token_ids={
                chunk.request_id: token
                for chunk, token in zip(launched.chunks, tokens, strict=True)
            }
        )

    def _forward(
        self,
        chunks: list[ScheduledChunk],
        on_layer_kv_written: Callable[[int], None] | None,
        between_layers: Callable[[], None] | None,
    ) -> torch.Tensor:
        """Run the model over ``chunks`` (in ``execute``'s order: decode rows first, generated
        tokens first among them), writing their KV; the logits of each chunk's prompt-logprob
        rows and sampled rows, in chunk order ``[rows, vocab]`` (``_pack``)."""
        num_decode = sum(chunk.num_tokens for chunk in chunks if _decode_rows(chunk))
        generated_chunks = [chunk for chunk in chunks if chunk.is_decode]
        generated = GeneratedRows(
            tokens=sum(chunk.num_tokens for chunk in generated_chunks),
            samples=sum(_samples(chunk) for chunk in generated_chunks),
        )
        input_ids, positions, logits_rows = self._pack(chunks)
        spans = [span for chunk in chunks for span in _spans(chunk)]
        adapters = self._step_adapters(chunks)
        graphs = self.decode_graphs
        if (
            graphs is not None
            and adapters is None
            and on_layer_kv_written is None
            and num_decode == len(input_ids)
            and not any(chunk.num_prompt_logprobs for chunk in chunks)
        ):
            # decode rows only, and no layer callback: its bucket's graph, where it has one
            logits = graphs.run(DecodeBatch(input_ids, positions, spans, logits_rows))
            if logits is not None:
                return logits
        metadata = self.backend.prepare(spans, num_decode, self.block_size, self.device)
        return self.model.forward(
            to_device(input_ids, torch.int64, self.device),
            to_device(positions, torch.int64, self.device),
            self.kv_cache,
            self.backend,
            metadata,
            to_device(logits_rows, torch.int64, self.device),
            on_layer_kv_written,
            generated,
            between_layers,
            adapters,
        )

    def _step_adapters(self, chunks: Sequence[ScheduledChunk]) -> StepTerms | None:
        """The LoRA adapter of each of the step's rows (its chunk's request's, by digest:
        ``ScheduledChunk.adapter``), in ``_pack``'s row order; None when no row takes one.
        The bank holds every adapter a running request takes (``EngineCore`` refuses a
        request of one it does not serve, and keeps an unloaded one banked until its
        requests end)."""
        bank = self.model.adapters
        if bank is None or not any(chunk.adapter for chunk in chunks):
            return None
        rows = [chunk.adapter for chunk in chunks for _ in range(chunk.num_tokens)]
        return bank.step(rows, self.device)

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> RunnerOutput:
        """Sample each sampling chunk's rows of ``logits``: its token (and logprobs, when
        asked), or with drafts the token after each of its tokens (a seeded generator then
        left as plain decoding would leave it, ``_rewind``)."""
        rows = [row for chunk in chunks for row in self._sampling_rows(chunk)]
        rewinds = self._rewind_points(chunks)
        sampled = self.sampler(logits, rows)
        output = RunnerOutput()
        row = 0
        for chunk in chunks:
            if chunk.draft_token_ids:  # no logprobs (``Scheduler._speculates``)
                verdicts = sampled.token_ids[row : row + chunk.num_tokens]
                output.verified_token_ids[chunk.request_id] = tuple(verdicts)
                row += chunk.num_tokens
                if chunk.request_id in rewinds:
                    self._rewind(chunk, verdicts, rewinds[chunk.request_id])
                continue
            output.sampled_token_ids[chunk.request_id] = sampled.token_ids[row]
            if sampled.logprobs[row] is not None:
                output.logprobs[chunk.request_id] = sampled.logprobs[row]
            row += 1
        return output

    @staticmethod
    def _pack(chunks: list[ScheduledChunk]) -> tuple[list[int], list[int], list[int]]:
        """Concatenate token ids and positions; the rows whose logits are computed: per chunk,
        its prompt-logprob rows (its first ``num_prompt_logprobs``), then its sampled rows
        (its last token's, or with drafts every token's)."""
        input_ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        for chunk in chunks:
            first_row = len(input_ids)
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_position, chunk.context_length))
            logits_rows.extend(range(first_row, first_row + chunk.num_prompt_logprobs))
            if chunk.samples:
                first = len(input_ids) - _samples(chunk)
                logits_rows.extend(range(first, len(input_ids)))
        return input_ids, positions, logits_rows

    def _skip_draws(self, generator: torch.Generator, chunk: ScheduledChunk) -> None:
        """A request that arrives with tokens already sampled elsewhere (its first token came
        from a prefill worker) continues the seeded stream where that worker left it (see the
        sampler's reproducibility contract)."""
        if chunk.params.temperature > 0:
            advance(generator, len(chunk.output_token_ids))

    def _rewind_points(self, chunks: Sequence[ScheduledChunk]) -> dict[str, torch.Tensor]:
        """The generator state of each seeded sampling request with drafts, before this
        step's draws (``_rewind``)."""
        return {
            chunk.request_id: self._generators[chunk.request_id].get_state()
            for chunk in chunks
            if chunk.draft_token_ids
            and not chunk.params.greedy
            and chunk.request_id in self._generators
        }

    def _rewind(self, chunk: ScheduledChunk, verdicts: Sequence[int], state: torch.Tensor) -> None:
        """Leave a seeded request's generator as plain decoding would: the draws of one
        sampled step per token it outputs (``sampler.advance``). Row ``j`` of a chunk with
        drafts sampled with the request's ``j``-th draw of the step, as plain decoding samples
        its ``j``-th next token, so the drafts kept and the token after them are plain
        decoding's tokens; the rows past them drew what the next steps must draw again."""
        kept = chunk.kept_drafts(verdicts)
        if kept + 1 == chunk.num_tokens:
            return  # every row's draw became an output token
        generator = self._generators[chunk.request_id]
        generator.set_state(state)
        advance(generator, kept + 1)

    def _sampling_rows(self, chunk: ScheduledChunk) -> list[SamplingRow]:
        """The chunk's sampling rows: one, or with drafts one per token, row ``j`` seeing the
        outputs plain decoding would have had there (the drafts before it kept), for the
        penalties and ``min_tokens`` that read them; a seeded request's rows share its
        generator, drawing in row order (``_rewind``)."""
        row = self._sampling_row(chunk)
        if not chunk.draft_token_ids:
            return [row]
        outputs = [*chunk.output_token_ids, *chunk.draft_token_ids]
        first = len(chunk.output_token_ids)
        return [
            dataclasses.replace(row, output_token_ids=outputs[: first + j])
            for j in range(chunk.num_tokens)
        ]

    def _sampling_row(self, chunk: ScheduledChunk) -> SamplingRow:
        generator = None
        if chunk.params.seed is not None:
            generator = self._generators.get(chunk.request_id)
            if generator is None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(chunk.params.seed)
                self._skip_draws(generator, chunk)
                self._generators[chunk.request_id] = generator
        allowed = None
        if chunk.params.grammar is not None:
            if self.grammars is None:
                raise RuntimeError("a constrained request reached an engine without grammars")
            allowed = self.grammars.allowed(
                chunk.request_id, chunk.params.grammar, chunk.output_token_ids,
                chunk.eos_token_ids,
            )  # fmt: skip
        return SamplingRow(
            params=chunk.params,
            generator=generator,
            prompt_token_ids=chunk.prompt_token_ids,
            output_token_ids=chunk.output_token_ids,
            eos_token_ids=chunk.eos_token_ids,
            allowed_token_mask=allowed,
        )


NATIVE_SAMPLER_ENV = "SPLITSERVE_NATIVE_SAMPLER"
"""``0``: the sampler keeps torch's ops on the CPU too (default: the C++ kernels,
``kernels/cpu_sampling.py``), for comparison."""

_PROMPT_LOGPROB_SLICE = 512
"""Prompt rows whose logprobs are computed together (bounds the float32 temporaries)."""


def _prompt_logprobs(
    chunks: Sequence[ScheduledChunk], logits: torch.Tensor, kernels: CpuSampling | None
) -> tuple[dict[str, tuple[int, tuple[TokenLogprob, ...]]], torch.Tensor]:
    """Split ``_forward``'s logits ``[rows, vocab]`` (``_pack``'s rows): each prompt-logprob
    chunk's records (``RunnerOutput.prompt_logprobs``; ``kernels`` as in ``token_logprobs``),
    and the sampled rows' logits ``[samples, vocab]`` in chunk order."""
    if not any(chunk.num_prompt_logprobs for chunk in chunks):
        return {}, logits
    records: dict[str, tuple[int, tuple[TokenLogprob, ...]]] = {}
    sampled_rows: list[int] = []
    row = 0
    for chunk in chunks:
        count = chunk.num_prompt_logprobs
        if count:
            first = chunk.start_position + 1
            described: list[TokenLogprob] = []
            for start in range(0, count, _PROMPT_LOGPROB_SLICE):
                end = min(count, start + _PROMPT_LOGPROB_SLICE)
                targets = chunk.prompt_token_ids[first + start : first + end]
                described += token_logprobs(
                    logits[row + start : row + end],  # [end - start, vocab]
                    to_device(list(targets), torch.int64, logits.device),
                    [chunk.params.prompt_logprobs or 0] * (end - start),
                    kernels,
                )
            records[chunk.request_id] = (first, tuple(described))
            row += count
        samples = _samples(chunk)
        sampled_rows.extend(range(row, row + samples))
        row += samples
    return records, logits[to_device(sampled_rows, torch.int64, logits.device)]


def _decode_rows(chunk: ScheduledChunk) -> bool:
    """Whether each of the chunk's tokens is a single-token sequence (a decode row): a
    one-token chunk, or a last sampled token with its drafts."""
    return chunk.num_tokens == 1 or bool(chunk.draft_token_ids)


def _samples(chunk: ScheduledChunk) -> int:
    """Tokens sampled for the chunk: one after each token with drafts, else one (or none)."""
    if not chunk.samples:
        return 0
    return chunk.num_tokens if chunk.draft_token_ids else 1


def _spans(chunk: ScheduledChunk) -> list[SequenceSpan]:
    """The attention's view of a chunk: one sequence, or one per decode row of a chunk with
    drafts (row ``i``'s context ends at its own token)."""
    if not chunk.draft_token_ids:
        return [SequenceSpan(chunk.num_tokens, chunk.context_length, chunk.block_table)]
    return [
        SequenceSpan(1, chunk.start_position + i + 1, chunk.block_table)
        for i in range(chunk.num_tokens)
    ]
