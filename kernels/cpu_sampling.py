"""The sampler's per-row work on the CPU (``cpu/sampling.cpp``): a filtered draw, and a chosen
token's logprob, rank and the most likely tokens.

``CpuSampling`` wraps the compiled library. ``sample`` takes the penalized float32 logits and
each row's temperature, top-k, top-p, min-p and uniform, and returns the token that
``engine/sampler.py``'s reproducibility contract picks: the same token as the torch path
except where a uniform or a top-p lands within float rounding of the boundary between two
tokens' cumulative masses (the sums run in another order; see the C++ contract).
``token_logprobs`` is ``log_softmax`` with the rank and top counted on its own values. Both
check the shapes, dtypes and layouts the C side trusts and raise ``ValueError`` otherwise.
``load_cpu_sampling`` returns None (logged) when the library is not installed, does not load,
or ``SPLITSERVE_CPU_KERNELS=0``; the sampler then keeps its torch path.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from splitserve.kernels.cpu_build import bind_functions, load_library, require

_P, _I, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "splitserve_sample_f32": [_P, _I, _I, _P, _P, _P, _P, _P, _P, _T],
    "splitserve_token_logprobs_f32": [_P, _I, _I, _P, _I, _P, _P, _P, _P, _T],
}


def _is_row_values(tensor: torch.Tensor, rows: int, dtype: torch.dtype) -> bool:
    return (
        tensor.dtype == dtype
        and tensor.shape == (rows,)
        and tensor.is_contiguous()
        and tensor.device.type == "cpu"
    )


def _is_logits(logits: torch.Tensor) -> bool:
    return (
        logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.is_contiguous()
        and logits.device.type == "cpu"
        and logits.shape[1] > 0
    )


@dataclass(frozen=True)
class RowLogprobs:
    """Per row of ``token_logprobs``: the chosen token's logprob and rank, and the top."""

    logprob: torch.Tensor  # [rows] float32
    rank: torch.Tensor  # [rows] int64, 1 = the most likely
    top_ids: torch.Tensor  # [rows, num_top] int64, most likely first
    top_logprobs: torch.Tensor  # [rows, num_top] float32


class CpuSampling:
    """The sampling kernels as tensor functions (float32, CPU, torch's intra-op threads)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        bind_functions(library, _SIGNATURES)
        self._library = library

    def sample(
        self,
        logits: torch.Tensor,  # [rows, vocab] float32 contiguous, penalized; not modified
        temperature: torch.Tensor,  # [rows] float32, > 0
        top_k: torch.Tensor,  # [rows] int64, 0 or >= vocab: off
        top_p: torch.Tensor,  # [rows] float32 in (0, 1]
        min_p: torch.Tensor,  # [rows] float32 in [0, 1]
        uniform: torch.Tensor,  # [rows] float32 in [0, 1)
    ) -> torch.Tensor:
        """One token per row, ``[rows]`` int64 (the contract in the module docstring)."""
        require(_is_logits(logits), "sample: logits must be contiguous 2-d float32 on the CPU")
        rows, vocab = logits.shape
        for name, values, dtype in (
            ("temperature", temperature, torch.float32),
            ("top_k", top_k, torch.int64),
            ("top_p", top_p, torch.float32),
            ("min_p", min_p, torch.float32),
            ("uniform", uniform, torch.float32),
        ):
            require(
                _is_row_values(values, rows, dtype),
                f"sample: {name} must be contiguous [{rows}] {dtype} on the CPU",
            )
        out = torch.empty(rows, dtype=torch.int64)
        status = self._library.splitserve_sample_f32(
            logits.data_ptr(),
            rows,
            vocab,
            temperature.data_ptr(),
            top_k.data_ptr(),
            top_p.data_ptr(),
            min_p.data_ptr(),
            uniform.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        require(
            status == 0,
            "sample: a row's temperature, top-k, top-p, min-p or uniform is out of range",
        )
        return out

    def token_logprobs(
        self,
        logits: torch.Tensor,  # [rows, vocab] float32 contiguous, raw
        chosen: torch.Tensor,  # [rows] int64 in [0, vocab)
        num_top: int,
    ) -> RowLogprobs:
        """Each row's ``chosen`` token's logprob under ``log_softmax``, its rank and the
        ``num_top`` most likely tokens (ties: the lower id first)."""
        require(
            _is_logits(logits), "token_logprobs: logits must be contiguous 2-d float32 on the CPU"
        )
        rows, vocab = logits.shape
        require(
            _is_row_values(chosen, rows, torch.int64),
            f"token_logprobs: chosen must be contiguous [{rows}] int64 on the CPU",
        )
        require(0 <= num_top <= vocab, f"token_logprobs: num_top must be in [0, {vocab}]")
        result = RowLogprobs(
            logprob=torch.empty(rows, dtype=torch.float32),
            rank=torch.empty(rows, dtype=torch.int64),
            top_ids=torch.empty(rows, num_top, dtype=torch.int64),
            top_logprobs=torch.empty(rows, num_top, dtype=torch.float32),
        )
        status = self._library.splitserve_token_logprobs_f32(
            logits.data_ptr(),
            rows,
            vocab,
            chosen.data_ptr(),
            num_top,
            result.logprob.data_ptr(),
            result.rank.data_ptr(),
            result.top_ids.data_ptr(),
            result.top_logprobs.data_ptr(),
            torch.get_num_threads(),
        )
        require(status == 0, "token_logprobs: a chosen token id is outside the vocabulary")
        return result


@functools.cache
def load_cpu_sampling(level: str | None = None) -> CpuSampling | None:
    """The compiled sampling kernels, or None (logged) if disabled or their library does not
    load here."""
    library = load_library("sampling", level)
    return None if library is None else CpuSampling(library)
