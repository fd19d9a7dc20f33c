"""The HF transformers baseline: one static batch through ``model.generate``.

The default GGUF is dequantized into a dense bf16 ``LlamaForCausalLM``; each run generates
greedily with ``min_new_tokens = max_new_tokens`` on a batch of equal-length prompts (no
padding). A ``StoppingCriteria`` that never stops stamps every step, so every row shares the
step timestamps; TTFT, TPOT and throughput (batch * tokens / wall) then come from
``timing_stats.run_metrics``. Also measures how many leading greedy tokens agree with
splitserve's (bf16 noise makes them diverge eventually).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from timing_stats import Json, RequestTiming, RunResult, run_metrics

from splitserve.common.model_files import default_model_path


def load_hf_model() -> Any:
    """The default GGUF, dequantized into a dense bf16 ``LlamaForCausalLM`` (no packed kernels)."""
    from transformers import AutoModelForCausalLM, GgufConfig

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    return model.eval()


def make_step_timer(stamps: list[float]) -> Any:
    """A ``StoppingCriteria`` that never stops and records when each generated token exists."""
    from transformers import StoppingCriteria

    class StepTimer(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    return StepTimer()


def run_hf_batch(model: Any, prompts: list[list[int]], max_tokens: int) -> RunResult:
    """One static batch through ``model.generate``; every row shares the step timestamps."""
    from transformers import StoppingCriteriaList

    input_ids = torch.tensor(prompts, dtype=torch.long)  # [batch, prompt_len]
    stamps: list[float] = []
    cpu_start, start = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=model.config.eos_token_id,
            stopping_criteria=StoppingCriteriaList([make_step_timer(stamps)]),
        )
    end, cpu_seconds = time.perf_counter(), time.process_time() - cpu_start
    new_tokens = output[:, input_ids.shape[1] :]  # [batch, generated]
    timings = [RequestTiming(start, list(stamps)) for _ in prompts]
    checks = {"requests_with_wrong_output_len": len(prompts) * (len(stamps) != max_tokens)}
    return RunResult(run_metrics(timings, start, end, cpu_seconds), new_tokens[0].tolist(), checks)


def greedy_agreement(ours: list[int], theirs: list[int]) -> Json:
    """How many leading output tokens of the first measured request match HF's (bf16 noise)."""
    matching = 0
    for a, b in zip(ours, theirs, strict=False):
        if a != b:
            break
        matching += 1
    return {"matching_prefix_tokens": matching, "compared_tokens": min(len(ours), len(theirs))}
