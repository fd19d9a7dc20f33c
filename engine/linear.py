"""Matrix-vector products for the model's projections, with CPU weight prepacking.

``Linear(weight, bias)`` computes ``x @ weight.T + bias`` for ``x`` ``[tokens, in]``. On CPU in
bfloat16 it stores the weight in oneDNN's blocked layout once at load time; that avoids the
per-call reorder that ``F.linear`` pays and reads weights closer to memory bandwidth (measured
here: 22 GB/s vs 15 GB/s over a SmolLM2-sized decode step). Everywhere else (float32, CUDA) it
is plain ``F.linear``.

Generated tokens' rows go through the C++ GEMV (``kernels/cpu/gemv.cpp``, bf16 on CPU,
when it can be built here; ``SPLITSERVE_DECODE_GEMV=0`` turns it off): it streams each weight
once with a software prefetch, where oneDNN's GEMV restarts the prefetcher's stream per matrix
and slows with every row (one core, SmolLM2's 121 matrices: 7.2-7.5 ms against 8.8-9.0 for
one row, 7.4-7.9 against 12.2-12.8 for 8, 21.9 against 24.8 for 32). Such a weight is held
twice, in oneDNN's layout for prompt rows and in the GEMV's (269 MB more for SmolLM2-135M),
except where the engine generates no tokens past a prompt's first (``decode_gemv=False``: a
prefill-only worker, whose rows are all prompt rows; its LM head keeps its copy, for float32
logits).

Which rows take which path is fixed by the row's kind, never by the step's size, so a row's
bits do not depend on what shares its step: the caller names the leading ``generated_rows`` of
``x`` (one-token decode chunks); those go through the GEMV, in calls of at most ``MAX_ROWS``
rows (a GEMV row's sums do not depend on the other rows), and every prompt row goes through
oneDNN, whose bf16 result for a row is the same whatever the step's row count (on CPUs without
AMX; see below). So a prompt's
tail computed after a cached prefix gives the bits of the whole prompt computed at once; the
GEMV sums in another order than oneDNN (an ulp apart), and letting it take a short prompt tail
once flipped a bf16 logit tie ("What is the capital of France?" answered "L'Étoile..." on its
cached second ask). A generated token's KV recomputed as part of a prompt (a request resumed
elsewhere) goes through oneDNN, so in bf16 its bits may differ by an ulp from the first
computation; float32 never takes the GEMV.

Where the GEMV pays depends on the CPU. Without AMX (the AMD EPYC above) it beats oneDNN up to
32 rows. With AMX (an Intel Xeon, one core, the same 121 matrices) oneDNN reads the weights
at 30-37 ms from 1 to 32 rows while the AVX-512 GEMV, bound by its BF16 arithmetic, grows
from 29 ms at one row to 60 at 16 and 106 at 32: a decode batch of 16 ran at 88 ms a token
against 65 without the GEMV. There the GEMV now takes AMX tiles (``kernels/cpu_gemv.py``:
18.8 ms at one row, 21.0 at 16, 27.0 at 32, against oneDNN's 36.7, 25.6 and 29.2 in the same
run), faster than oneDNN at every row count, so every generated row takes it, whatever the
step's size. Where the GEMV is the AVX-512 loop, by default (``SPLITSERVE_DECODE_GEMV=auto``)
the model measures, once at load, up to how many generated rows it is no slower than oneDNN
on this machine (``measure_gemv_row_limit``, at least one row); a step with more generated
rows takes oneDNN for all of them. ``SPLITSERVE_DECODE_GEMV=1`` takes the GEMV at every row count
(the bit property below for any batch), ``0`` never. The LM head is apart: its rows are
logits, which take the kernel's float32 sums always (``Linear.logits``).

Quantized weights read as stored (``--quantized-weights native``; ``quantized`` below): where
the weight came from a GGUF's Q4_1 or Q8_0 blocks and the kernel reads their shape, the rows
that would take the GEMV (generated tokens' and logits rows) read the blocks instead
(``kernels/cpu_qgemv.py``: 5 or 8.5 bits a weight against 16), in bf16 models and in float32
ones, and no GEMV copy is kept; prompt rows keep the dense path over the widened weight. In
float32 the kernel sums the file's exact float32 weights, so only the summation order differs
from the dense path; every generated row takes it whatever the step's size (no row limit is
measured), so a row's bits never depend on its batch.

A prompt row's bits are the same whatever the step's row count only where oneDNN's are: on
the AMD EPYC above they were; with AMX (the Intel Xeon above) oneDNN sums a row of a call of
fewer than ~37 rows in another order than the same row in a larger call (every projection
shape of SmolLM2; from 37 rows on, a row's bits depend neither on the call's size nor on the
row's place in it). There a prompt's short tail after a cached prefix can differ from the
whole prompt by an ulp. (Padding such calls to 64 rows made them agree; it is not done, as it
costs a short prompt the compute of 64 rows.) Logits in float32 (``Linear.logits``) keep such
ulps from deciding greedy's token at a bf16 logit tie.

Batch invariance in float32 on CPU: the BLAS picks a different kernel (and so a different
summation order) for 1, for 2-4 and for 5 or more rows, so a request's logits would depend on
how many other requests share its step, and greedy output can flip on the model's narrower
margins. Inputs with fewer than ``MIN_GEMM_ROWS`` rows are padded with zero rows, so every row
always goes through the same kernel: float32 results are identical whatever the batch.
"""

from __future__ import annotations

import functools
import os
import threading
import time

import torch
import torch.nn.functional as F

from splitserve.engine.checkpoint import QuantizedTensor
from splitserve.kernels.cpu_gemv import MAX_ROWS, CpuGemv, GemvWeight, load_cpu_gemv
from splitserve.kernels.cpu_qgemv import SUPPORTED_TYPES, CpuQGemv, QuantWeight, load_cpu_qgemv

DECODE_GEMV_ENV = "SPLITSERVE_DECODE_GEMV"
"""``auto`` (default): generated tokens' rows take the C++ GEMV up to the row count measured
at load; ``1``: at every row count; ``0``: never, oneDNN (see above)."""
PROMPT_BLOCKS_ENV = "SPLITSERVE_PROMPT_BLOCKS"
"""``0``: a float32 weight read as stored keeps its widened copy for prompt rows, and a tied
embedding read as stored its widened table (default: prompt rows unpack the blocks per prompt
step, ``Linear.dense_from_blocks``, and tokens are looked up in the LM head's blocks,
``LlamaModel.embedding_from_blocks``)."""
GEMV_PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
"""Row counts ``measure_gemv_row_limit`` times, in order. Past 32 the row kernels run in
calls of ``MAX_ROWS`` rows, each reading the weights again, while oneDNN's GEMM reads them
once: on the AMD EPYC (Zen 5, one core, the default model's Q4_1/Q8_0 projections read as
stored) the quantized kernel took 21.6 ms for 32 rows against oneDNN's 22.4, but 44.2 for 64
against 35.5 and 82.8 for 128 against 61.5. Probing only up to 32 found "no limit" there, and
every larger step paid the difference."""
GEMV_SLOWER = 1.05
"""The GEMV counts as slower at a row count where it takes more than this times oneDNN's
time (timings on a shared core scatter by a few percent)."""
MIN_GEMM_ROWS = 8
"""Float32 CPU inputs are padded to at least this many rows (see the module docstring)."""


def decode_gemv_setting() -> str:
    """``SPLITSERVE_DECODE_GEMV``: ``auto`` (unset too), ``1`` or ``0``; anything else is
    refused (``ValueError``) rather than guessed."""
    value = os.environ.get(DECODE_GEMV_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "1", "0"):
        raise ValueError(f"{DECODE_GEMV_ENV} must be auto, 1 or 0, not {value!r}")
    return value


def prompt_blocks_setting() -> bool:
    """``SPLITSERVE_PROMPT_BLOCKS``: weights read as stored hold no widened copy (on unless
    ``0``)."""
    return os.environ.get(PROMPT_BLOCKS_ENV, "1") != "0"


def measure_gemv_row_limit(linears: list[Linear], repeats: int = 7) -> int | None:
    """Up to how many generated rows the GEMV is no slower than oneDNN over ``linears``
    (each holding a GEMV copy), on this machine, now: the last of ``GEMV_PROBE_ROWS`` before
    the first where the GEMV's fastest pass takes more than ``GEMV_SLOWER`` times oneDNN's
    fastest, over ``repeats`` passes of each, in two rounds of passes; at least 1 (one row
    reads the weights once either way); None when it is no slower at any probed count (no
    limit).

    The fastest pass, not the median, and the two kernels' passes alternated: on a shared
    machine other processes only ever add time, so a median judged one kernel by the phase
    of noise its passes fell into (seen on a 2-core AMD EPYC: one load in three limited the
    GEMV to 8 rows where it is the faster kernel at every count up to 32). A second round
    confirms a count where the first found the GEMV slower (``all`` stops after a first
    round that finds it no slower)."""
    generator = torch.Generator().manual_seed(0)
    limit = None
    for rows in GEMV_PROBE_ROWS:
        inputs = {
            linear.in_features: torch.randn(rows, linear.in_features, generator=generator).to(
                torch.bfloat16
            )  # [rows, in]
            for linear in linears
        }
        if all(_gemv_slower(linears, inputs, rows, repeats) for _ in range(2)):
            return limit or 1
        limit = rows
    return None


def _gemv_slower(
    linears: list[Linear], inputs: dict[int, torch.Tensor], rows: int, repeats: int
) -> bool:
    """Whether one round finds the GEMV's fastest pass with ``rows`` generated rows over
    ``GEMV_SLOWER`` times oneDNN's."""
    gemv_s, onednn_s = _fastest_passes_s(linears, inputs, rows, repeats)
    return gemv_s > GEMV_SLOWER * onednn_s


def _fastest_passes_s(
    linears: list[Linear], inputs: dict[int, torch.Tensor], rows: int, repeats: int
) -> tuple[float, float]:
    """Seconds of the fastest pass over ``linears`` (input by in-features) with ``rows``
    generated rows (the GEMV) and with none (oneDNN), their passes alternated, after a
    warm-up pass of each (caches, oneDNN's kernel choice)."""
    fastest = {rows: float("inf"), 0: float("inf")}
    with torch.inference_mode():
        for repeat in range(repeats + 1):
            for generated_rows in (rows, 0):
                started = time.perf_counter()
                for linear in linears:
                    linear(inputs[linear.in_features], generated_rows)
                if repeat:
                    elapsed = time.perf_counter() - started
                    fastest[generated_rows] = min(fastest[generated_rows], elapsed)
    return fastest[rows], fastest[0]


def _quant_readable(weight: torch.Tensor, quantized: QuantizedTensor) -> bool:
    """Whether the quantized kernel can take ``quantized`` as ``weight``'s row path."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float32)
        and tuple(weight.shape) == (quantized.out_features, quantized.in_features)
        and CpuQGemv.supports(quantized.ggml_type, quantized.out_features, quantized.in_features)
    )


@functools.cache
def _prepacking_available() -> bool:
    """Whether oneDNN prepacks bf16 weights here: it computes bf16 only on CPUs with AVX-512
    (BW, VL, DQ) or AVX-NE-CONVERT (elsewhere ``F.linear``'s slow bf16 path keeps working)."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class Linear:
    """A projection ``[tokens, in] -> [tokens, out]`` with a fixed weight ``[out, in]``."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        decode_gemv: bool = True,
        logits: bool = False,
        quantized: QuantizedTensor | None = None,
        prompt_rows_from_blocks: bool | None = None,
    ) -> None:
        """``decode_gemv=False``: keep no GEMV copy of the weight (every row takes oneDNN);
        for an engine that never computes generated tokens' rows. ``logits``: the LM head,
        whose every row (a prompt's last or a generated token's) takes the GEMV's float32
        sums where it is loaded, whatever ``decode_gemv`` and ``SPLITSERVE_DECODE_GEMV``
        (see ``logits`` below). ``quantized``: the weight's GGUF blocks (``weight`` their
        dequantized values in the model's dtype); where the quantized kernel reads their type
        and shape, the rows that would take the GEMV read these blocks instead
        (``kernels/cpu_qgemv.py``), in bf16 and in float32 models, and no GEMV copy is kept;
        prompt rows still take ``weight``. ``prompt_rows_from_blocks``: in float32, where the
        blocks are read, ``weight`` is not kept either: prompt rows unpack the blocks into a
        scratch buffer of the thread (``_BlockScratch``) before the same dense product, whose
        weight values, and so bits, are the widened weight's (the weight held once, as
        stored, for the cost of unpacking it per prompt step); None: ``SPLITSERVE_PROMPT_BLOCKS``
        (on unless ``0``)."""
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # [out, in]
        self.bias = bias  # [out] or None
        self.prepacked = (
            weight.device.type == "cpu"
            and weight.dtype == torch.bfloat16
            and _prepacking_available()
        )
        self._gemv: CpuGemv | None = None
        self._gemv_weight: GemvWeight | None = None
        self.gemv_max_rows: int | None = None
        """Steps with more generated rows than this take oneDNN for every row (None: no
        limit); set by the model from ``measure_gemv_row_limit``."""
        self.logits = logits
        """Rows out in float32, never rounded to bf16, where the GEMV is loaded: a bf16
        logit's step (1/16 between 8 and 16) turns near ties into exact ones, which greedy
        breaks by token id, so the answer hung on an ulp of the hidden state (the default
        model, bf16, on an AMX Xeon: "What is the capital of France?" answered "L'Étoile,
        la Marseillaise, ..."; with float32 logits "The capital of France is Paris.", as in
        float32). Every row takes the same row-invariant path, so a logit's bits do not
        depend on its row's kind or its step, and a prefill-only worker's first token comes
        from the same sums as a decode worker's."""
        gemv_wanted = logits or (decode_gemv and decode_gemv_setting() != "0")
        self._qgemv: CpuQGemv | None = None
        self._quant_weight: QuantWeight | None = None
        if gemv_wanted and quantized is not None and _quant_readable(weight, quantized):
            kernel = load_cpu_qgemv()
            if kernel is not None and kernel.reads(weight.dtype):
                self._qgemv = kernel
                self._quant_weight = self._qgemv.pack(quantized.blocks, quantized.ggml_type)
        if (
            self._quant_weight is None
            and gemv_wanted
            and self.prepacked
            and CpuGemv.supports(weight)
        ):
            self._gemv = load_cpu_gemv()
            if self._gemv is not None:
                self._gemv_weight = self._gemv.pack(weight)
        if prompt_rows_from_blocks is None:
            prompt_rows_from_blocks = prompt_blocks_setting()
        self.dense_from_blocks = (
            prompt_rows_from_blocks
            and weight.dtype == torch.float32
            and self._quant_weight is not None
            and not self.logits
        )
        """Whether prompt rows unpack the blocks rather than read a kept dense weight."""
        if self.dense_from_blocks or (self.logits and self.has_row_kernel):
            # no row reads a dense weight: prompt rows unpack the blocks, or (the LM head) every
            # row takes the row kernel; none is held, none prepacked (a tied head's weight is
            # the embedding table)
            self.prepacked = False
            self.weight = None  # type: ignore[assignment]
        if self.prepacked:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.pad_rows = weight.device.type == "cpu" and weight.dtype == torch.float32

    @property
    def reads_quantized(self) -> str | None:
        """The GGUF type name whose blocks this weight's kernel rows read, None if dense."""
        weight = self._quant_weight
        return None if weight is None else SUPPORTED_TYPES[weight.ggml_type]

    @property
    def has_row_kernel(self) -> bool:
        """Whether generated (or logits) rows take a kernel of their own (the GEMV or the
        quantized one) rather than ``weight``'s dense path."""
        return self._gemv_weight is not None or self._quant_weight is not None

    @property
    def takes_amx(self) -> bool:
        """Whether this weight's GEMV rows take the AMX kernel (``kernels/cpu_gemv.py``)."""
        gemv, weight = self._gemv, self._gemv_weight
        return gemv is not None and weight is not None and gemv.uses_amx(weight)

    def __call__(self, x: torch.Tensor, generated_rows: int = 0) -> torch.Tensor:
        """``x @ weight.T + bias`` for ``x`` ``[tokens, in]``; the leading ``generated_rows``
        rows are generated tokens (they take the GEMV where it is loaded, see above). Float32
        for ``logits`` where the GEMV is loaded, else ``x``'s dtype."""
        rows = x.shape[0]
        if self.logits and self.has_row_kernel:
            if rows == 0:  # a step whose chunks all end mid-prompt samples nothing
                return x.new_empty((0, self.out_features), dtype=torch.float32)
            if rows <= MAX_ROWS:
                return self._row_kernel(x, float_out=True)
            return torch.cat(self._gemv_calls(x, float_out=True))
        if not self.has_row_kernel or generated_rows <= 0:
            return self._dense(x)
        if self.gemv_max_rows is not None and generated_rows > self.gemv_max_rows:
            return self._dense(x)
        if generated_rows == rows and rows <= MAX_ROWS:  # a decode-only step: one call
            return self._row_kernel(x, float_out=False)
        parts = self._gemv_calls(x[:generated_rows], float_out=False)
        if generated_rows < rows:
            parts.append(self._dense(x[generated_rows:]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Rows ``ids`` of the weight read from its blocks, ``[*ids.shape, in]`` float32 (the
        widened weight's values before its cast to the model's dtype), where the quantized
        kernel reads them; None otherwise. A tied LM head's weight is the embedding table:
        the model looks tokens up here instead of holding the table widened."""
        if self._qgemv is None or self._quant_weight is None:
            return None
        return self._qgemv.rows(self._quant_weight, ids)

    @property
    def generated_rows_quant_weight(self) -> QuantWeight | None:
        """The packed blocks a decode-only step's generated rows read in ``__call__`` (one
        call, up to ``MAX_ROWS`` rows and ``gemv_max_rows``); None where they take another
        path (the GEMV, oneDNN) or this is the LM head."""
        if self._qgemv is None or self.logits:
            return None
        return self._quant_weight

    def _row_kernel(self, x: torch.Tensor, float_out: bool) -> torch.Tensor:
        """Rows ``x`` ``[<= MAX_ROWS, in]`` through the row kernel: quantized where loaded,
        else the GEMV; ``[rows, out]``, x's dtype or float32."""
        if self._qgemv is not None and self._quant_weight is not None:
            return self._qgemv(x, self._quant_weight, self.bias, float_out)
        assert self._gemv is not None and self._gemv_weight is not None
        return self._gemv(x, self._gemv_weight, self.bias, float_out)

    def _gemv_calls(self, x: torch.Tensor, float_out: bool) -> list[torch.Tensor]:
        """Every row of ``x`` through the row kernel, in calls of at most ``MAX_ROWS`` rows (a
        row's sums do not depend on the others): each part ``[<= MAX_ROWS, out]``."""
        return [
            self._row_kernel(x[start : start + MAX_ROWS], float_out)
            for start in range(0, x.shape[0], MAX_ROWS)
        ]

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN (prepacked bf16) or ``F.linear`` for all rows of ``x``."""
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        rows = x.shape[0]
        weight = self.weight
        if self.dense_from_blocks:
            assert self._qgemv is not None and self._quant_weight is not None
            weight = _SCRATCH.unpacked(self._qgemv, self._quant_weight)  # [out, in]
        if self.pad_rows and rows < MIN_GEMM_ROWS:
            padded = x.new_zeros(MIN_GEMM_ROWS, x.shape[1])  # [MIN_GEMM_ROWS, in]
            padded[:rows] = x
            return F.linear(padded, weight, self.bias)[:rows]
        return F.linear(x, weight, self.bias)


class _BlockScratch(threading.local):
    """Each thread's float32 buffer for weights unpacked from their blocks
    (``Linear.dense_from_blocks``), grown to the largest weight it held; one weight at a time
    (the product that reads it returns before the next unpacks)."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0)

    def unpacked(self, kernel: CpuQGemv, weight: QuantWeight) -> torch.Tensor:
        """``weight``'s dense values ``[out, in]`` in this thread's buffer."""
        size = weight.out_features * weight.in_features
        if self.buffer.numel() < size:
            self.buffer = torch.empty(size)
        return kernel.unpack(weight, self.buffer)


_SCRATCH = _BlockScratch()
