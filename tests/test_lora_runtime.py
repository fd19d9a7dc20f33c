"""LoRA adapters loaded and unloaded while the engine serves (``EngineCore.serve_adapter``,
``unserve_adapter``): float32 greedy output equal to PEFT's, as for adapters loaded at start.

An engine started with no adapter serves one loaded at runtime; an unloaded adapter's
requests already running finish with it (their tokens still PEFT's) while new ones are
refused; a name loaded again with other files never meets the old files' cached KV; other
files loaded in place under a served name (``replace``) serve the requests that come next
while those running finish with the old files.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from splitserve.common.errors import InvalidRequestError, ModelLoadError, ModelNotFoundError
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine import lora
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.checkpoint import LoadedCheckpoint
from splitserve.engine.config import ModelConfig
from tests.conftest import assert_no_leaks, make_llm
from tests.lora_adapters import peft_greedy

NEW_TOKENS = 12
PROMPT = "The capital of France is"


def _params(adapter: str) -> SamplingParams:
    return SamplingParams(
        max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, adapter=adapter
    )


def test_an_adapter_loaded_at_runtime_equals_peft_until_unloaded(
    default_checkpoint_fp32: LoadedCheckpoint, lora_adapters
) -> None:
    every = lora_adapters["every"]
    prompt = default_checkpoint_fp32.tokenizer.encode(PROMPT)
    expected = peft_greedy(every.model, prompt, NEW_TOKENS)
    llm = make_llm(default_checkpoint_fp32)
    engine = llm.engine
    assert engine.runner.model.adapters is None
    with pytest.raises(ModelNotFoundError):
        llm.generate([prompt], _params("every"))

    adapter = engine.read_adapter("every", every.folder)
    assert engine.serve_adapter("every", adapter) is True
    assert engine.serve_adapter("every", adapter) is False  # the same files: nothing changes
    assert llm.generate([prompt], _params("every"))[0].token_ids == expected
    # the same files under a second name share one slot of the bank
    assert engine.serve_adapter("every-too", adapter) is True
    assert llm.generate([prompt], _params("every-too"))[0].token_ids == expected
    assert engine.runner.model.adapters.digests == (adapter.digest,)

    other = engine.read_adapter("every", lora_adapters["qv"].folder)
    with pytest.raises(InvalidRequestError, match="other files"):
        engine.serve_adapter("every", other)
    with pytest.raises(ModelLoadError, match="adapter_config.json"):
        engine.read_adapter("broken", Path(every.folder).parent / "missing")

    engine.unserve_adapter("every")
    with pytest.raises(ModelNotFoundError):
        llm.generate([prompt], _params("every"))
    with pytest.raises(ModelNotFoundError):
        engine.unserve_adapter("every")
    assert llm.generate([prompt], _params("every-too"))[0].token_ids == expected
    engine.unserve_adapter("every-too")
    assert engine.runner.model.adapters is None  # nothing served, nothing running
    assert_no_leaks(llm)


def test_an_unloaded_adapters_running_requests_finish_with_it(
    default_checkpoint_fp32: LoadedCheckpoint, lora_adapters
) -> None:
    every = lora_adapters["every"]
    prompt = default_checkpoint_fp32.tokenizer.encode(PROMPT)
    expected = peft_greedy(every.model, prompt, NEW_TOKENS)
    llm = make_llm(default_checkpoint_fp32)
    engine = llm.engine
    engine.serve_adapter("every", engine.read_adapter("every", every.folder))
    tokens: list[int] = []
    for chunk in llm.stream([prompt], _params("every")):
        if not tokens:  # after its first token: unloaded mid-request
            engine.unserve_adapter("every")
            assert engine.runner.model.adapters is not None  # kept for the running request
            with pytest.raises(ModelNotFoundError):
                engine.validate_request(prompt, _params("every"))
        tokens.extend(chunk.new_token_ids)
    assert tokens == expected
    assert engine.runner.model.adapters is None  # its last request ended: the bank let it go
    assert_no_leaks(llm)


def test_a_name_loaded_again_with_other_files_meets_none_of_the_old_kv(
    default_checkpoint_fp32: LoadedCheckpoint, lora_adapters
) -> None:
    """The prefix cache is keyed by the adapter's digest, not its name: a long prompt cached
    under ``tuned`` (one version) is not found under ``tuned`` loaded from other files, whose
    tokens are then the other adapter's (PEFT's), not a mix."""
    tokenizer = default_checkpoint_fp32.tokenizer
    prompt = tokenizer.encode(" ".join([PROMPT] * 14))
    assert len(prompt) > 64
    llm = make_llm(default_checkpoint_fp32)
    engine = llm.engine

    def run() -> tuple[list[int], int]:
        before = engine.scheduler.stats.prefix_hit_tokens
        tokens = llm.generate([prompt], _params("tuned"))[0].token_ids
        return tokens, engine.scheduler.stats.prefix_hit_tokens - before

    engine.serve_adapter("tuned", engine.read_adapter("tuned", lora_adapters["every"].folder))
    first, _ = run()
    again, hits = run()
    assert again == first and hits >= 64  # cached under this version
    engine.unserve_adapter("tuned")
    engine.serve_adapter("tuned", engine.read_adapter("tuned", lora_adapters["qv"].folder))
    tokens, hits = run()
    assert hits == 0
    assert tokens == peft_greedy(lora_adapters["qv"].model, prompt, NEW_TOKENS) != first
    assert_no_leaks(llm)


def test_files_replaced_in_place_serve_new_requests_and_running_ones_keep_theirs(
    default_checkpoint_fp32: LoadedCheckpoint, lora_adapters
) -> None:
    """vLLM's ``load_inplace``, as RL trainers use it to swap a policy's adapter each
    step: a request running when ``tuned`` is replaced finishes with the old files (PEFT's
    tokens of ``every``), one that starts after gets the new ones' (PEFT's of ``qv``); a
    check (``check_only``) refuses as the load would and changes nothing; the old files
    leave the bank once their last request ended."""
    every, qv = lora_adapters["every"], lora_adapters["qv"]
    prompt = default_checkpoint_fp32.tokenizer.encode(PROMPT)
    old, new = (
        peft_greedy(every.model, prompt, NEW_TOKENS),
        peft_greedy(qv.model, prompt, NEW_TOKENS),
    )
    llm = make_llm(default_checkpoint_fp32, max_lora_adapters=1)
    engine = llm.engine
    engine.serve_adapter("tuned", engine.read_adapter("tuned", every.folder))
    replacement = engine.read_adapter("tuned", qv.folder)
    assert engine.serve_adapter("tuned", replacement, replace=True, check_only=True) is True
    assert engine.adapter_digest("tuned") != replacement.digest  # a check changes nothing
    with pytest.raises(InvalidRequestError, match="load_inplace"):
        engine.serve_adapter("tuned", replacement, check_only=True)
    with pytest.raises(InvalidRequestError, match="--max-lora-adapters"):  # a second name
        engine.serve_adapter("other", replacement, check_only=True)

    tokens: list[int] = []
    for chunk in llm.stream([prompt], _params("tuned")):
        if not tokens:  # after its first token: replaced mid-request
            assert engine.serve_adapter("tuned", replacement, replace=True) is True
            assert engine.adapter_digest("tuned") == replacement.digest
            assert len(engine.runner.model.adapters.digests) == 2  # the old kept for it
        tokens.extend(chunk.new_token_ids)
    assert tokens == old
    assert engine.runner.model.adapters.digests == (replacement.digest,)  # the old let go
    assert llm.generate([prompt], _params("tuned"))[0].token_ids == new != old
    assert engine.serve_adapter("tuned", replacement, replace=True) is False  # same files
    assert_no_leaks(llm)


def test_a_worker_serves_at_most_max_lora_adapters(
    default_checkpoint_fp32: LoadedCheckpoint, lora_adapters
) -> None:
    """Distinct files count, not names; an unload makes room."""
    every, qv = lora_adapters["every"].folder, lora_adapters["qv"].folder
    with pytest.raises(InvalidRequestError, match="max_lora_adapters"):
        ModelConfig(lora_modules=(("a", str(every)), ("b", str(qv))), max_lora_adapters=1)
    llm = make_llm(default_checkpoint_fp32, max_lora_adapters=1)
    engine = llm.engine
    assert engine.serve_adapter("every", engine.read_adapter("every", every))
    assert engine.serve_adapter("same-files", engine.read_adapter("same-files", every))
    with pytest.raises(InvalidRequestError, match="--max-lora-adapters"):
        engine.serve_adapter("qv", engine.read_adapter("qv", qv))
    engine.unserve_adapter("every")
    engine.unserve_adapter("same-files")
    assert engine.serve_adapter("qv", engine.read_adapter("qv", qv))


def test_max_lora_rank_refuses_larger_adapters_and_max_loras_keeps_peft_tokens(
    default_checkpoint_fp32: LoadedCheckpoint, lora_adapters
) -> None:
    """vLLM's ``--max-lora-rank`` (``every`` is rank 8, ``qv`` rank 4) and ``--max-loras``:
    with one adapter among the running requests at a time, requests of two adapters and of
    the base model sent together each still get their own tokens (PEFT's; the base model's
    alone; the order they run in: ``tests/test_scheduler.py``)."""
    every, qv = lora_adapters["every"], lora_adapters["qv"]
    with pytest.raises(ModelLoadError, match="--max-lora-rank"):
        make_llm(
            default_checkpoint_fp32, lora_modules=(("every", str(every.folder)),), max_lora_rank=4
        )
    llm = make_llm(
        default_checkpoint_fp32,
        lora_modules=(("qv", str(qv.folder)),),
        max_lora_rank=4,
        max_loras=1,
    )
    with pytest.raises(ModelLoadError, match="rank 8, above"):
        llm.engine.read_adapter("every", every.folder)
    bounded = make_llm(
        default_checkpoint_fp32,
        lora_modules=(("every", str(every.folder)), ("qv", str(qv.folder))),
        max_loras=1,
    )
    prompt = default_checkpoint_fp32.tokenizer.encode(PROMPT)
    names = ["every", "qv", "", "every", "qv"]
    engine = bounded.engine
    assert [(a.adapter, a.running, a.waiting) for a in engine.lora_requests()] == [
        ("every", 0, 0),
        ("qv", 0, 0),
    ]
    for index, name in enumerate(names):
        engine.add_request(f"counted-{index}", prompt, _params(name))
    engine.step()  # every's two run, qv's two wait for room (the base model's runs)
    assert [(a.adapter, a.running, a.waiting) for a in engine.lora_requests()] == [
        ("every", 2, 0),
        ("qv", 0, 2),
    ]
    for index in range(len(names)):
        engine.abort_request(f"counted-{index}")
    results = bounded.generate([prompt] * len(names), [_params(name) for name in names])
    expected = {
        "every": peft_greedy(every.model, prompt, NEW_TOKENS),
        "qv": peft_greedy(qv.model, prompt, NEW_TOKENS),
        "": make_llm(default_checkpoint_fp32).generate([prompt], _params(""))[0].token_ids,
    }
    assert [r.token_ids for r in results] == [expected[name] for name in names]
    assert bounded.engine.scheduler.kv_cache.num_free_blocks == bounded.engine.num_blocks
    assert_no_leaks(bounded)


def test_each_adapter_apart_when_more_are_loaded_than_the_bank_takes(
    default_checkpoint_fp32: LoadedCheckpoint, lora_adapters, monkeypatch
) -> None:
    """Past ``BANK_MAX_ADAPTERS`` loaded, each adapter's factors are apart: a request whose
    rows are the whole step (no gather) still gets PEFT's tokens, and unloading back to the
    bank's size lays them side by side again."""
    monkeypatch.setattr(lora, "BANK_MAX_ADAPTERS", 1)
    every, qv = lora_adapters["every"], lora_adapters["qv"]
    prompt = default_checkpoint_fp32.tokenizer.encode(PROMPT)
    llm = make_llm(default_checkpoint_fp32)
    engine = llm.engine
    engine.serve_adapter("every", engine.read_adapter("every", every.folder))
    assert isinstance(engine.runner.model.adapters, lora.AdapterBank)
    engine.serve_adapter("qv", engine.read_adapter("qv", qv.folder))
    assert isinstance(engine.runner.model.adapters, lora.AdapterGroups)
    assert llm.generate([prompt], _params("qv"))[0].token_ids == peft_greedy(
        qv.model, prompt, NEW_TOKENS
    )
    engine.unserve_adapter("every")
    assert isinstance(engine.runner.model.adapters, lora.AdapterBank)
    assert_no_leaks(llm)


def test_a_load_apart_keeps_the_loaded_adapters_products(
    default_checkpoint_fp32: LoadedCheckpoint, lora_adapters, monkeypatch
) -> None:
    """Each adapter apart, a runtime load prepacks only the new adapter's products: those
    of the adapters already loaded are the same objects in the new layout, and still give
    PEFT's tokens."""
    monkeypatch.setattr(lora, "BANK_MAX_ADAPTERS", 0)
    every, qv = lora_adapters["every"], lora_adapters["qv"]
    prompt = default_checkpoint_fp32.tokenizer.encode(PROMPT)
    llm = make_llm(default_checkpoint_fp32)
    engine = llm.engine
    engine.serve_adapter("every", engine.read_adapter("every", every.folder))
    first = engine.runner.model.adapters
    engine.serve_adapter("qv", engine.read_adapter("qv", qv.folder))
    second = engine.runner.model.adapters
    assert isinstance(first, lora.AdapterGroups) and isinstance(second, lora.AdapterGroups)
    digest = engine.adapter_digest("every")
    kept = second.layers[0]["qkv"][second.slot[digest]]
    assert kept is not None and kept is first.layers[0]["qkv"][first.slot[digest]]
    assert llm.generate([prompt], _params("every"))[0].token_ids == peft_greedy(
        every.model, prompt, NEW_TOKENS
    )
    assert_no_leaks(llm)


def test_a_served_engine_lays_adapters_out_off_its_thread(
    default_checkpoint_fp32: LoadedCheckpoint, lora_adapters, monkeypatch
) -> None:
    """``AsyncEngine``: a load's layout is built on the reading thread and only swapped in
    on the engine thread (the model's ``set_adapters`` never runs there); after an unload
    the engine keeps the old layout until a thread of its own has built the new one; the
    tokens are PEFT's throughout."""
    every, qv = lora_adapters["every"], lora_adapters["qv"]
    llm = make_llm(default_checkpoint_fp32)
    engine = AsyncEngine(llm.engine)
    model = llm.engine.runner.model
    engine_thread_layouts: list[str] = []
    set_adapters = model.set_adapters

    def counted(adapters) -> None:  # noqa: ANN001
        engine_thread_layouts.append(threading.current_thread().name)
        set_adapters(adapters)

    monkeypatch.setattr(model, "set_adapters", counted)
    prompt = default_checkpoint_fp32.tokenizer.encode(PROMPT)

    async def run() -> None:
        await engine.load_adapter("every", Path(every.folder))
        await engine.load_adapter("qv", Path(qv.folder))
        assert model.adapters is not None and len(model.adapters.digests) == 2
        got = {}
        for name in ("every", "qv"):
            tokens: list[int] = []
            async for output in engine.generate(f"r-{name}", prompt, _params(name)):
                tokens.extend(output.update.new_token_ids)
            got[name] = tokens
        assert got == {
            "every": peft_greedy(every.model, prompt, NEW_TOKENS),
            "qv": peft_greedy(qv.model, prompt, NEW_TOKENS),
        }
        await engine.unload_adapter("every")
        for _ in range(500):  # laid out again off the engine thread, then swapped in
            if len(model.adapters.digests) == 1:
                break
            await asyncio.sleep(0.01)
        assert model.adapters.digests == (engine.adapter_digest("qv"),)
        await engine.unload_adapter("qv")
        for _ in range(500):
            if model.adapters is None:
                break
            await asyncio.sleep(0.01)
        assert model.adapters is None

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    assert engine_thread_layouts == []  # every layout was prepared, none built in place
    assert_no_leaks(llm)
