"""``bench/gpu/step_times.py``'s prefill under a prefill worker's layer hook (``LayerGather``),
run on the CPU with the ``tiny`` random model so the one GPU call does not meet its first
error: every layer of the prompt is gathered once, as the cache holds it, and the timed step
computes the whole prompt."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_decode_graphs import _llm

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_the_layer_gather_copies_every_layer_of_the_prompt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.syspath_prepend(str(BENCH / "gpu"))
    import step_times

    engine = _llm().engine
    runner = engine.runner
    prompt = torch.randint(2, 500, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    gather = step_times.LayerGather(runner, len(prompt))
    assert step_times.prefill_step_ms(engine, prompt, gather) > 0
    num_layers = runner.kv_cache.shape[0]
    assert gather.gathered == num_layers and len(gather.blocks) == 3  # 37 tokens, blocks of 16
    expected = runner.kv_cache[:, :, gather.blocks]  # [layers, 2, blocks, ...]
    assert torch.equal(gather.staging, expected)
    assert not engine.has_unfinished
