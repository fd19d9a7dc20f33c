"""Shared fixtures: the default model loaded once per session, in float32 for exact checks; the
KV transport backend under test; a real etcd server; real clusters shared by several test
modules (``tests/shared.py``: started once, stopped after their last user); the 25 slowest
tests printed by every run."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from splitserve.common.grammar import GrammarCompiler, GrammarSpec
from splitserve.common.model_files import default_model_path
from splitserve.engine.checkpoint import LoadedCheckpoint, load_checkpoint
from splitserve.engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    RunnerConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from splitserve.engine.llm import LLM
from tests.cluster import Served
from tests.cluster import served_cluster as start_served_cluster
from tests.etcd import EtcdServer, running_etcd
from tests.fault_cluster import FaultCluster
from tests.fault_cluster import ha_cluster as start_ha_cluster
from tests.lora_adapters import SavedAdapter, saved_adapters
from tests.shared import Shared, group_users, last_users, stop_all

SHARED_CLUSTERS: dict[str, Shared[object]] = {
    "served_cluster": Shared("served_cluster", start_served_cluster),
    "ha_cluster": Shared("ha_cluster", start_ha_cluster, FaultCluster.heal),
}
"""Shared fixture name -> its cluster (``tests/shared.py``)."""
_last_user: dict[str, str] = {}
"""Shared fixture name -> node id of the last test of this run that uses it."""


def pytest_configure(config: pytest.Config) -> None:
    if config.option.durations is None:
        config.option.durations = 25  # every run names its slowest tests


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items[:] = group_users(items, list(SHARED_CLUSTERS))


def pytest_collection_finish(session: pytest.Session) -> None:
    _last_user.clear()
    _last_user.update(last_users(session.items, list(SHARED_CLUSTERS)))


def pytest_sessionfinish(session: pytest.Session) -> None:
    for failure in stop_all(list(SHARED_CLUSTERS.values())):
        print(f"\nshared cluster did not stop cleanly: {failure}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _stop_shared_clusters_after_their_last_user(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for name, shared in SHARED_CLUSTERS.items():
        if shared.running and name in request.fixturenames:
            shared.after_test()
        if shared.running and _last_user.get(name) == request.node.nodeid:
            shared.stop()  # raises (an error of this test) if a process did not stop cleanly


@pytest.fixture(scope="session")
def ha_cluster() -> FaultCluster:
    """``tests/fault_cluster.py:ha_cluster``, shared by the fault tests; whole again after
    each of them."""
    return SHARED_CLUSTERS["ha_cluster"].get()  # type: ignore[return-value]


@pytest.fixture(scope="session")
def served_cluster() -> Served:
    """``tests/cluster.py:served_cluster``, shared by every module that asks for it."""
    return SHARED_CLUSTERS["served_cluster"].get()  # type: ignore[return-value]


@pytest.fixture(scope="session")
def default_checkpoint_fp32() -> LoadedCheckpoint:
    """SmolLM2-135M-Instruct (the GGUF of the default model package) dequantized to float32,
    with its quantized blocks kept (for engines made with ``quantized_weights="native"``)."""
    return load_checkpoint(default_model_path(), torch.float32, keep_quantized=True)


@pytest.fixture(scope="session")
def compiler(default_checkpoint_fp32: LoadedCheckpoint) -> GrammarCompiler:
    """Structured outputs' compiler over the default model's tokenizer (its llguidance
    tokenizer built once, at the first constraint)."""
    checkpoint = default_checkpoint_fp32
    eos = sorted(checkpoint.config.eos_token_ids)
    return GrammarCompiler(checkpoint.tokenizer, checkpoint.config.vocab_size, eos)


def constraint_takes(compiler: GrammarCompiler, spec: GrammarSpec, text: str) -> bool:
    """Whether ``text``'s tokens, fed one by one to llguidance's matcher of ``spec``, take it
    to an accepting state (every token allowed on the way)."""
    from llguidance import LLMatcher

    matcher = LLMatcher(compiler.tokenizer, compiler.compile(spec))
    for token in compiler.tokenizer.tokenize_str(text):
        if not matcher.consume_token(token):
            return False
    return not matcher.is_error() and matcher.is_accepting()


@pytest.fixture(scope="session")
def hf_default_model_fp32() -> torch.nn.Module:
    """HF ``transformers``' own load of the default model's GGUF, float32, in eval mode: the
    reference of weights (``test_checkpoint_loading``) and of greedy output
    (``test_correctness_hf``), loaded once. Do not modify it."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    with _gguf_read_once(path):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="session")
def hf_default_tokenizer() -> object:
    """HF ``transformers``' own tokenizer of the default model's GGUF (the reference of
    ``test_tokenizer`` and ``test_detokenizer``), loaded once. Do not modify it."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    with _gguf_read_once(path):
        return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@functools.cache
def _gguf_reader(path: Path) -> object:
    """The ``gguf`` package's reader of ``path``, parsed once per session (read only)."""
    import gguf

    return gguf.GGUFReader(path)


@contextlib.contextmanager
def _gguf_read_once(path: Path) -> Iterator[None]:
    """While ``transformers`` loads ``path``: the ``gguf`` package's reader parses the file
    once a session (``transformers`` opens it twice per load, for the config and for the
    weights or tokenizer, and most of its load time is that parse of the tokenizer's
    arrays) and each tensor name map is built once (it builds one per tensor). The same
    objects the package would make, made fewer times: the model loaded is the same
    (checked: equal state dicts)."""
    import gguf

    reader = _gguf_reader(path)

    def read(given: object, *args: object, **kwargs: object) -> object:
        return reader if Path(str(given)) == path else unpatched(given, *args, **kwargs)

    unpatched = gguf.GGUFReader
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", read)
        patch.setattr(
            gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
        )
        yield


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory, hf_default_model_fp32) -> dict[str, SavedAdapter]:
    """Two LoRA adapters PEFT made over the default model and saved
    (``tests/lora_adapters.py:saved_adapters``), by name, with their PEFT models."""
    return saved_adapters(hf_default_model_fp32, tmp_path_factory.mktemp("lora"))


@pytest.fixture(params=["inprocess", "ucx"])
def transport_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """The KV transport backend under test; after a UCX test the process-wide ucxx context is
    reset (ucxx allows one per process)."""
    kind: str = request.param
    if kind == "ucx":
        ucxx = pytest.importorskip("ucxx", reason="UCX (ucxx) is not installed here")
        yield kind
        ucxx.reset()
    else:
        yield kind


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A real etcd server (``tests/etcd.py``) on free localhost ports with its data under
    ``tmp_path``; stopped after the test (``stop()``/``start()`` in between: an outage)."""
    with running_etcd(tmp_path) as server:
        yield server


def make_llm(
    checkpoint: LoadedCheckpoint,
    *,
    num_blocks: int | None = 512,
    block_size: int = 16,
    prefix_caching: bool = True,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 64,
    dtype: str = "float32",
    attention_backend: str = "auto",
    speculative_tokens: int = 0,
    quantized_weights: str = "auto",
    lora_modules: tuple[tuple[str, str], ...] = (),
    max_lora_adapters: int = 16,
    max_lora_rank: int = 0,
    max_loras: int = 0,
) -> LLM:
    """An offline engine over an already loaded checkpoint, float32 by default
    (``speculative_tokens``: prompt-lookup drafts per step, 0 = none; ``quantized_weights``
    as ``ModelConfig``'s, whose "auto" reads the checkpoint's kept GGUF blocks in bf16;
    ``lora_modules``: LoRA adapters served, (name, folder) pairs, at most
    ``max_lora_adapters``, of rank at most ``max_lora_rank``; ``max_loras``: the most
    adapters among the running requests; 0: no bound)."""
    config = EngineConfig(
        model=ModelConfig(
            dtype=dtype,
            quantized_weights=quantized_weights,
            lora_modules=lora_modules,
            max_lora_adapters=max_lora_adapters,
            max_lora_rank=max_lora_rank,
        ),
        cache=CacheConfig(
            block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_loras=max_loras,
        ),
        runner=RunnerConfig(num_threads=2, attention_backend=attention_backend),
        speculative=SpeculativeConfig(num_tokens=speculative_tokens),
    )
    return LLM(config=config, checkpoint=checkpoint)


def assert_no_leaks(llm: LLM) -> None:
    """Every KV block is back in the pool and no request is left."""
    engine = llm.engine
    assert not engine.has_unfinished
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
