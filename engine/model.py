"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over a paged KV cache.

Weights are kept as plain tensors with fused projections (``qkv`` and ``gate_up``) so a layer is
a handful of large matmuls. Numerics mirror HF ``transformers``: RMSNorm in float32 then cast,
RoPE tables in the model dtype, logits cast to float32. In bf16 on CPU (and in the float32
that ``--dtype auto`` picks) the residual add and the RMSNorm after it, the rotary embedding
and SiLU * up run as C++ kernels (``kernels/cpu_fused_ops.py``); a float32 named by
``--dtype float32`` keeps HF's ops. On CUDA in bf16/fp16 those three steps are one Triton
kernel each (``kernels/triton_fused_ops.py``). Where every projection reads its GGUF blocks, a
decode-only step runs the whole layer loop in C (``kernels/cpu_decode_layers.py``, the same
kernels and bits as the loop here).

``forward`` takes a packed batch (all sequences' new tokens concatenated) and returns logits
only for the tokens listed in ``logits_indices`` (the last token of each sampling sequence).
"""

from __future__ import annotations

import importlib.util
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from splitserve.common.errors import ModelLoadError
from splitserve.engine.checkpoint import QuantizedTensor
from splitserve.engine.linear import (
    Linear,
    decode_gemv_setting,
    measure_gemv_row_limit,
    prompt_blocks_setting,
)
from splitserve.engine.lora import AdapterLayout, LoraAdapter, StepTerms, adapter_layout
from splitserve.engine.model_config import ModelArchConfig
from splitserve.engine.rotary import apply_rotary, cos_sin_table
from splitserve.kernels.attention import AttentionBackend, TorchAttentionMetadata
from splitserve.kernels.cpu_backend import CpuAttentionBackend
from splitserve.kernels.cpu_decode_layers import (
    CpuDecodeLayers,
    DecodeLayerTensors,
    DecodeShape,
    KernelAddresses,
    decode_layers_enabled,
    load_decode_layers_library,
)
from splitserve.kernels.cpu_fused_ops import CpuFusedOps, load_cpu_fused_ops
from splitserve.kernels.cpu_qgemv import MAX_ROWS, load_cpu_qgemv

if TYPE_CHECKING:  # imported when used: the Triton kernels load on CUDA only
    from splitserve.kernels.triton_fused_ops import TritonFusedOps


@dataclass
class DecoderLayerWeights:
    """One decoder layer's tensors (model dtype, on the model device)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> q_size + 2 * kv_size (bias for Qwen2)
    o_proj: Linear  # q_size -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF computes it: normalize in float32, cast back, then scale.

    In float32 the HF formula is used literally (bit-exact comparison); in reduced precision
    torch's fused kernel (one op instead of seven; it also accumulates in float32).
    """
    if x.dtype != torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


logger = logging.getLogger(__name__)

GEMV_PROBE_LAYERS = 4
"""Decoder layers whose projections time the decode GEMV against oneDNN at load."""


@dataclass(frozen=True)
class GeneratedRows:
    """How many leading rows of a packed step are generated tokens (one-token decode chunks
    whose token is output, not prompt): ``tokens`` of the step's rows, ``samples`` of its
    logits rows. ``Linear`` sends exactly these through the decode GEMV (see
    ``engine/linear.py``), so a row's path depends on its kind, never on the step's size."""

    tokens: int = 0
    samples: int = 0


class LlamaModel:
    """The decoder stack plus embedding and LM head; stateless apart from its weights."""

    def __init__(
        self,
        config: ModelArchConfig,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        decode_gemv: bool = True,
        quantized: Mapping[str, QuantizedTensor] | None = None,
        fused_float32: bool = False,
    ) -> None:
        """``decode_gemv=False``: the projections keep no copy of their weights for the
        decode GEMV (``engine/linear.py``), for an engine that generates no tokens past a
        prompt's first (a prefill-only worker). ``quantized``: GGUF blocks by HF name
        (``LoadedCheckpoint.quantized``); the projections (fused ones when every part has
        blocks of one type) and the LM head whose blocks the quantized kernel reads take
        them for generated and logits rows instead of a GEMV copy (``engine/linear.py``).
        ``fused_float32``: in float32 too, the residual add and RMSNorm run as one fused CPU
        kernel (its squares summed in another order than HF's), for a float32 that is not the
        exactness reference (``engine_core.serving_dtype``); without it float32 takes HF's
        formula op for op."""
        self.config = config
        self._decode_gemv = decode_gemv
        blocks: Mapping[str, QuantizedTensor] = quantized or {}  # packed by Linear, not kept
        self.dtype = dtype
        self.device = device
        take = _WeightTaker(weights, dtype, device)
        self.embed_tokens = take("model.embed_tokens.weight")  # [vocab, hidden]
        self.layers = [self._layer(take, i, blocks) for i in range(config.num_hidden_layers)]
        self.norm = take("model.norm.weight")  # [hidden]
        head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        lm_head = self.embed_tokens if config.tie_word_embeddings else take(head_name)
        self.lm_head = Linear(
            lm_head, logits=True, quantized=blocks.get(head_name)
        )  # hidden -> vocab
        self.embedding_from_blocks = (
            config.tie_word_embeddings
            and self.lm_head.reads_quantized is not None
            and prompt_blocks_setting()
        )
        """Whether tokens are looked up in the tied LM head's blocks (``Linear.embedding_rows``,
        the widened table's values, cast as it was) rather than in a widened table, which is
        then not held."""
        if self.embedding_from_blocks:
            self.embed_tokens = None  # type: ignore[assignment]
        if quantized is not None:
            self._report_quantized(blocks)
        self._limit_decode_gemv()
        self.cos, self.sin = cos_sin_table(
            config.head_dim, config.rope_theta, config.rope_scaling, max_positions, dtype, device
        )  # [positions, head_dim] each
        self.scale = config.head_dim**-0.5
        self._fused_ops = _fused_ops_for(dtype, device, fused_float32)
        self._gpu_ops = _gpu_ops_for(dtype, device, config.num_attention_heads)
        """On CUDA in bf16/fp16: the add + RMSNorm, rotary and SiLU * up as one Triton kernel
        each (``kernels/triton_fused_ops.py``); None elsewhere."""
        self._decode_layers = self._decode_layers_for()
        self.adapters: AdapterLayout | None = None
        """The LoRA adapters' factors (``engine/lora.py``), laid out by ``set_adapters``; a
        step's rows name theirs (by digest) in ``forward``'s ``adapters``."""
        self._decode_layers_max_rows = min(
            [MAX_ROWS, *(p.gemv_max_rows or MAX_ROWS for p in self._layer_projections())]
        )
        """Decode-only steps of up to this many rows take ``_decode_layers``."""

    def set_adapters(self, adapters: Sequence[LoraAdapter]) -> None:
        """Hold ``adapters`` (loaded for this model's shapes, dtype and device; one per
        digest) from the next step on, in a new bank (a step launched before keeps the
        bank it was given); none: no bank."""
        self.adapters = self.layout_for(adapters)

    def layout_for(self, adapters: Sequence[LoraAdapter]) -> AdapterLayout | None:
        """The layout ``adapters`` would take in this model (``engine/lora.py:adapter_layout``,
        reusing the current layout's products where it can), built without taking it: any
        thread (``EngineCore.prepare_layout``)."""
        return adapter_layout(adapters, self.config.num_hidden_layers, self.adapters)

    def _decode_layers_for(self) -> CpuDecodeLayers | None:
        """The C layer loop of decode-only steps (``kernels/cpu_decode_layers.py``) where it
        applies: the fused ops loaded and every projection's generated rows on the quantized
        kernel; else None (every step keeps the Python loop)."""
        fused, qgemv = self._fused_ops, load_cpu_qgemv()
        if fused is None or qgemv is None or not decode_layers_enabled():
            return None
        tensors = []
        for layer in self.layers:
            weights = [
                p.generated_rows_quant_weight
                for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
            ]
            qkv, o_proj, gate_up, down = weights
            if qkv is None or o_proj is None or gate_up is None or down is None:
                return None
            tensors.append(
                DecodeLayerTensors(
                    layer.input_norm, layer.post_norm, qkv, layer.qkv.bias, o_proj, gate_up, down
                )
            )
        library = load_decode_layers_library()
        if library is None:
            return None
        cfg = self.config
        kernels = KernelAddresses(
            qgemv=qgemv.address,
            add_rms_norm=fused.address("add_rms_norm", self.dtype),
            rotary=fused.address("rotary", self.dtype),
            silu_mul=fused.address("silu_mul", self.dtype),
        )
        shape = DecodeShape(
            hidden_size=cfg.hidden_size,
            q_heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            intermediate=cfg.intermediate_size,
            eps=cfg.rms_norm_eps,
            scale=self.scale,
        )
        logger.info("decode-only steps run their layer loop in C (kernels/cpu_decode_layers.py)")
        return CpuDecodeLayers(library, self.dtype, kernels, tensors, shape)

    def _layer_projections(self) -> list[Linear]:
        """Every decoder layer's projections, in order (not the LM head)."""
        return [
            linear
            for layer in self.layers
            for linear in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        ]

    def _limit_decode_gemv(self) -> None:
        """Under ``SPLITSERVE_DECODE_GEMV=auto``, measure on the first layers' projections up
        to how many generated rows the decode GEMV pays on this machine, and hold every
        projection to it (``engine/linear.py``); not the LM head, whose rows are logits and
        always take the GEMV. Where every projection takes the AMX kernel there is no limit
        to measure: it reads the weights at oneDNN's speed or better at every row count
        (``kernels/cpu_gemv.py``), and a step's generated rows then keep one kernel's bits
        whatever their number."""
        projections = self._layer_projections()
        if decode_gemv_setting() != "auto" or not projections[0].has_row_kernel:
            return
        if self.dtype != torch.bfloat16:  # float32 reading quantized blocks: rows of one kernel
            return
        if all(linear.takes_amx for linear in projections):
            logger.info("decode GEMV: AMX tiles, for steps of any number of generated rows")
            return
        limit = measure_gemv_row_limit(projections[: 4 * GEMV_PROBE_LAYERS])
        for linear in projections:
            linear.gemv_max_rows = limit
        logger.info(
            "decode GEMV: for steps of %s generated rows (measured against oneDNN here)",
            "any number of" if limit is None else f"at most {limit}",
        )

    def _report_quantized(self, blocks: Mapping[str, QuantizedTensor]) -> None:
        """Log which weights read their GGUF blocks as stored and which keep the dense path
        (a type or shape the quantized kernel cannot read, or no generated rows to serve)."""
        linears = [*self._layer_projections(), self.lm_head]
        native = Counter(linear.reads_quantized for linear in linears if linear.reads_quantized)
        dense = len(linears) - sum(native.values())
        other = sorted({tensor.type_name for tensor in blocks.values()} - set(native))
        if not blocks:
            logger.warning("quantized weights asked for, but the model has no quantized tensors")
            return
        logger.info(
            "quantized weights: %s matrices read their blocks as stored (%s); %d keep the "
            "dense %s path%s",
            sum(native.values()),
            ", ".join(f"{count} {name}" for name, count in sorted(native.items())) or "none",
            dense,
            self.dtype,
            f" (types the kernel does not read: {', '.join(other)})" if other else "",
        )

    def _layer(
        self, take: _WeightTaker, index: int, blocks: Mapping[str, QuantizedTensor]
    ) -> DecoderLayerWeights:
        prefix = f"model.layers.{index}."
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        qkv_names = [attn + f"{p}_proj.weight" for p in "qkv"]
        qkv_bias = None
        if self.config.attention_bias:
            qkv_bias = torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"])
        gate_up_names = [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
        gemv = self._decode_gemv
        return DecoderLayerWeights(
            input_norm=take(prefix + "input_layernorm.weight"),
            qkv=Linear(
                torch.cat([take(name) for name in qkv_names]),
                qkv_bias,
                gemv,
                quantized=QuantizedTensor.stacked([blocks.get(name) for name in qkv_names]),
            ),
            o_proj=Linear(
                take(attn + "o_proj.weight"),
                decode_gemv=gemv,
                quantized=blocks.get(attn + "o_proj.weight"),
            ),
            post_norm=take(prefix + "post_attention_layernorm.weight"),
            gate_up=Linear(
                torch.cat([take(name) for name in gate_up_names]),
                decode_gemv=gemv,
                quantized=QuantizedTensor.stacked([blocks.get(name) for name in gate_up_names]),
            ),
            down=Linear(
                take(mlp + "down_proj.weight"),
                decode_gemv=gemv,
                quantized=blocks.get(mlp + "down_proj.weight"),
            ),
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens] int64
        positions: torch.Tensor,  # [tokens] int64
        kv_cache: torch.Tensor,  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        backend: AttentionBackend,
        attn_metadata: object,
        logits_indices: torch.Tensor,  # [samples] int64
        on_layer_kv_written: Callable[[int], None] | None = None,
        generated: GeneratedRows = GeneratedRows(),
        between_layers: Callable[[], None] | None = None,
        adapters: StepTerms | None = None,
    ) -> torch.Tensor:
        """Run the packed batch; returns float32 logits ``[samples, vocab]``.

        ``adapters``: the rows that take a LoRA adapter's terms (``engine/lora.py``); such a
        step runs the Python layer loop.

        ``generated`` names the batch's leading rows that are generated tokens (and of the
        logits rows, their samples); the rest are prompt rows.

        ``on_layer_kv_written(layer)`` is called as soon as a layer's new KV is in the cache
        (before its MLP runs), so a KV push can overlap the rest of the forward pass.

        ``between_layers()`` is called before each layer but the first of the Python layer
        loop and between each layer's attention and its MLP (steps with prompt rows; a decode
        step's layer loop in C runs whole), where the engine may resize its thread pool
        (``engine/step_threads.py``): stretches of a few milliseconds, so that a lender turning
        busy gets its core back within about half a layer.
        """
        cfg = self.config
        if self.embedding_from_blocks:
            rows = self.lm_head.embedding_rows(input_ids)
            assert rows is not None
            hidden = rows.to(self.dtype)  # [tokens, hidden]
        else:
            hidden = F.embedding(input_ids, self.embed_tokens)  # [tokens, hidden]
        cos, sin = self.cos[positions], self.sin[positions]  # [tokens, head_dim]
        num_tokens = input_ids.shape[0]
        if (
            adapters is None
            and on_layer_kv_written is None
            and self._takes_decode_layers(num_tokens, generated, backend, attn_metadata, kv_cache)
        ):
            assert self._decode_layers is not None and isinstance(backend, CpuAttentionBackend)
            assert isinstance(attn_metadata, TorchAttentionMetadata)
            delta = self._decode_layers(
                hidden,
                cos,
                sin,
                attn_metadata.slot_mapping,
                attn_metadata.decode_block_tables,
                attn_metadata.decode_context_lens,
                kv_cache,
                backend.decode_kernel.address(self.dtype),
            )  # [tokens, hidden]; hidden updated in place
            return self._logits(hidden + delta, logits_indices, generated)
        q_heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        delta = None  # [tokens, hidden]: the MLP output still to be added to ``hidden``
        for index, layer in enumerate(self.layers):
            if between_layers is not None and index:
                between_layers()
            hidden, normed = self._add_and_norm(hidden, delta, layer.input_norm)
            qkv = layer.qkv(normed, generated.tokens)  # [tokens, q + 2 kv]
            if adapters is not None:
                qkv = adapters.add_to(qkv, normed, index, "qkv")
            query_key = qkv[:, : cfg.q_size + cfg.kv_size].view(
                num_tokens, q_heads + kv_heads, head_dim
            )
            query_key = self._rotary(query_key, cos, sin, positions)  # [tokens, q + kv heads, dim]
            value = qkv[:, cfg.q_size + cfg.kv_size :].view(num_tokens, kv_heads, head_dim)
            attn = backend.forward(
                query_key[:, :q_heads],
                query_key[:, q_heads:],
                value,
                kv_cache[index, 0],
                kv_cache[index, 1],
                attn_metadata,
                self.scale,
            )  # [tokens, q_size]
            if on_layer_kv_written is not None:
                on_layer_kv_written(index)
            attn_out = layer.o_proj(attn, generated.tokens)  # [tokens, hidden]
            if adapters is not None:
                attn_out = adapters.add_to(attn_out, attn, index, "o_proj")
            hidden, normed = self._add_and_norm(hidden, attn_out, layer.post_norm)
            if between_layers is not None:
                between_layers()
            gate_up = layer.gate_up(normed, generated.tokens)  # [tokens, 2 * intermediate]
            if adapters is not None:
                gate_up = adapters.add_to(gate_up, normed, index, "gate_up")
            activated = self._silu_mul(gate_up)  # [tokens, intermediate]
            delta = layer.down(activated, generated.tokens)  # [tokens, hidden]
            if adapters is not None:
                delta = adapters.add_to(delta, activated, index, "down")
        if delta is not None:
            hidden = hidden + delta
        return self._logits(hidden, logits_indices, generated)

    def _logits(
        self,
        hidden: torch.Tensor,  # [tokens, hidden]: the residual stream after the last layer
        logits_indices: torch.Tensor,  # [samples] int64
        generated: GeneratedRows,
    ) -> torch.Tensor:
        """The final norm and the LM head over the sampled rows: float32 ``[samples, vocab]``."""
        last = hidden.index_select(0, logits_indices)  # [samples, hidden]
        last = rms_norm(last, self.norm, self.config.rms_norm_eps)
        return self.lm_head(last, generated.samples).float()  # [samples, vocab]

    def _takes_decode_layers(
        self,
        num_tokens: int,
        generated: GeneratedRows,
        backend: AttentionBackend,
        attn_metadata: object,
        kv_cache: torch.Tensor,
    ) -> bool:
        """Whether this step runs ``_decode_layers``: every row a generated token whose
        projections take the quantized kernel in one call and whose attention the CPU
        backend's paged kernel computes, over tables it checked (``forward``'s Python loop
        would call the same kernels in the same order)."""
        return (
            self._decode_layers is not None
            and 0 < num_tokens <= self._decode_layers_max_rows
            and generated.tokens == num_tokens
            and isinstance(backend, CpuAttentionBackend)
            and isinstance(attn_metadata, TorchAttentionMetadata)
            and attn_metadata.num_decode == num_tokens
            and not attn_metadata.prefill_spans
            and self.dtype in backend.decode_kernel.dtypes
            and kv_cache.dtype == self.dtype
            and backend.tables_checked(kv_cache[0, 0])
        )

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [tokens, 2 * intermediate]
        """``silu(gate) * up`` ``[tokens, intermediate]``: the fused kernel where the fused ops
        are loaded (the C layer loop calls it too, so both give the same bits), else torch."""
        if self._gpu_ops is not None:
            return self._gpu_ops.silu_mul(gate_up)
        if self._fused_ops is not None:
            return self._fused_ops.silu_mul(gate_up.contiguous())
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _rotary(
        self,
        query_key: torch.Tensor,  # [tokens, heads, head_dim], a view of the qkv rows
        cos: torch.Tensor,  # [tokens, head_dim]
        sin: torch.Tensor,  # [tokens, head_dim]
        positions: torch.Tensor,  # [tokens] int64
    ) -> torch.Tensor:
        """``apply_rotary``, in one call of the fused CPU kernel where it is loaded (bit for
        bit the same result, ``kernels/cpu_fused_ops.py``), or of the Triton kernel on CUDA
        in bf16/fp16 (in place, over the whole tables at ``positions``)."""
        if self._gpu_ops is not None:
            return self._gpu_ops.rotary(query_key, self.cos, self.sin, positions)
        if self._fused_ops is not None:
            return self._fused_ops.rotary(query_key, cos, sin)
        return apply_rotary(query_key, cos, sin)

    def _add_and_norm(
        self,
        hidden: torch.Tensor,  # [tokens, hidden]
        delta: torch.Tensor | None,  # [tokens, hidden]
        weight: torch.Tensor,  # [hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden + delta, rms_norm(hidden + delta) * weight)``; no add when ``delta`` is
        None. With the fused CPU kernel ``hidden`` is updated in place."""
        if self._gpu_ops is not None:
            return self._gpu_ops.add_rms_norm(hidden, delta, weight, self.config.rms_norm_eps)
        if self._fused_ops is not None:
            normed = self._fused_ops.add_rms_norm(hidden, delta, weight, self.config.rms_norm_eps)
            return hidden, normed
        if delta is not None:
            hidden = hidden + delta
        return hidden, rms_norm(hidden, weight, self.config.rms_norm_eps)


def _fused_ops_for(
    dtype: torch.dtype, device: torch.device, fused_float32: bool
) -> CpuFusedOps | None:
    """The fused CPU kernels where they apply (bf16 on CPU; float32 on CPU where
    ``fused_float32``) and can be built, else None."""
    takes = dtype == torch.bfloat16 or (dtype == torch.float32 and fused_float32)
    if device.type != "cpu" or not takes:
        return None
    return load_cpu_fused_ops()


def _gpu_ops_for(dtype: torch.dtype, device: torch.device, q_heads: int) -> TritonFusedOps | None:
    """``TritonFusedOps`` on CUDA in bf16/fp16 where Triton is installed, else None."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    from splitserve.kernels.triton_fused_ops import FUSED_DTYPES, TritonFusedOps

    return TritonFusedOps(q_heads) if dtype in FUSED_DTYPES else None


class _WeightTaker:
    """Fetches a named weight, checks it exists, casts it to the model dtype and device."""

    def __init__(
        self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> None:
        self._weights = weights
        self._dtype = dtype
        self._device = device

    def __call__(self, name: str) -> torch.Tensor:
        tensor = self._weights.get(name)
        if tensor is None:
            raise ModelLoadError(f"checkpoint lacks tensor {name!r}")
        return tensor.to(device=self._device, dtype=self._dtype).contiguous()
