"""Checkpoint loading: GGUF (default file and synthetic ones), safetensors folders, bad input."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import pre_tokenizers

from splitserve.common.errors import ModelLoadError
from splitserve.common.model_files import default_model_path, resolve_model_path
from splitserve.engine.checkpoint import LoadedCheckpoint, load_checkpoint
from splitserve.engine.model_config import RopeScaling

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers needs it to load a GGUF model

Q = gguf.GGMLQuantizationType
CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}


def tiny_model(kind: str, vocab_size: int, **overrides: object) -> torch.nn.Module:
    """A 2-layer, hidden-64 random model with every parameter (norms too) randomized."""
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }
    config_class, model_class = classes[kind]
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    model = model_class(config_class(**settings))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.05)
    return model.eval()


def hf_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    weights = {name: value.detach().clone() for name, value in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight")
    return weights


def assert_config_matches(checkpoint: LoadedCheckpoint, hf_config) -> None:
    for name in CONFIG_FIELDS:
        expected = getattr(hf_config, name, None)
        if name == "head_dim" and expected is None:  # Qwen2Config has no head_dim
            expected = hf_config.hidden_size // hf_config.num_attention_heads
        assert getattr(checkpoint.config, name) == pytest.approx(expected), name
    assert checkpoint.config.rope_theta == pytest.approx(hf_config.rope_parameters["rope_theta"])


# ---------------------------------------------------------------------------------------------
# the default GGUF against transformers' own GGUF loader


@pytest.fixture(scope="module")
def default_checkpoint(default_checkpoint_fp32: LoadedCheckpoint) -> LoadedCheckpoint:
    """``load_checkpoint(default_model_path(), torch.float32)``, shared with other modules."""
    return default_checkpoint_fp32


@pytest.fixture(scope="module")
def reference(hf_default_model_fp32: torch.nn.Module):
    model = hf_default_model_fp32
    return model.config, {name: value.detach() for name, value in model.state_dict().items()}


def test_default_gguf_config(default_checkpoint: LoadedCheckpoint, reference) -> None:
    hf_config, _ = reference
    assert_config_matches(default_checkpoint, hf_config)
    config = default_checkpoint.config
    assert (config.architecture, config.attention_bias) == ("llama", False)
    assert config.rope_scaling == RopeScaling()
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert default_checkpoint.tokenizer.vocab_size == config.vocab_size


def test_default_gguf_weights_equal_transformers(
    default_checkpoint: LoadedCheckpoint, reference
) -> None:
    # transformers un-permutes llama.cpp's q/k rows too, so equality proves our un-permutation.
    _, state_dict = reference
    weights = default_checkpoint.weights
    assert set(weights) == set(state_dict) - {"lm_head.weight"}  # tied embeddings
    for name, value in weights.items():
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, state_dict[name], rtol=0, atol=0, msg=name)


def test_default_path_resolution() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert resolve_model_path(None) == resolve_model_path("default") == path
    assert resolve_model_path("some/dir") == Path("some/dir")


# ---------------------------------------------------------------------------------------------
# synthetic GGUF files written the way llama.cpp's converter writes them

BYTE_TOKENS = ["<|endoftext|>", *pre_tokenizers.ByteLevel.alphabet()]
GGUF_LAYER_PARTS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# a mix of storage types; the expected values go through the same quantize/dequantize round trip
STORAGE = {"embed_tokens": Q.Q8_0, "q_proj": Q.F16, "k_proj": Q.Q8_0, "v_proj": Q.BF16}
STORAGE |= {"o_proj": Q.Q4_0, "gate_proj": Q.Q4_1, "up_proj": Q.Q5_1}  # gguf cannot write K-quants


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp converter: each head's rows from [half, j] order to interleaved [j, half]."""
    head_dim = weight.shape[0] // num_heads
    grouped = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[hf_name]
    layer, part, kind = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_name).groups()
    return f"blk.{layer}.{GGUF_LAYER_PARTS[part]}.{kind}"


def storage_type(hf_name: str, columns: int) -> Q:
    """The type ``STORAGE`` names, Q8_0 where a row is no whole number of its blocks."""
    parts = hf_name.split(".")
    qtype = STORAGE.get(parts[-2], Q.F32) if parts[-1] == "weight" else Q.F32
    return qtype if columns % gguf.GGML_QUANT_SIZES[qtype][0] == 0 else Q.Q8_0


def write_model_gguf(
    path: Path, model, arch: str, rope_freqs: np.ndarray | None = None, skip: str = ""
) -> dict:
    """Write ``model`` as llama.cpp would; return the HF-layout values the loader must produce."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(BYTE_TOKENS)
    writer.add_token_types([3] + [1] * 256)
    writer.add_token_merges([])
    writer.add_eos_token_id(0)
    expected = {}
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, value in hf_weights(model).items():
        if name == skip:
            continue
        array, qtype = value.numpy(), storage_type(name, value.shape[-1])
        array = gguf.quants.dequantize(gguf.quants.quantize(array, qtype), qtype)
        expected[name] = torch.from_numpy(array.astype(np.float32).reshape(value.shape))
        projection = name.split(".")[-2]
        if arch == "llama" and projection in heads:
            array = llama_cpp_permute(array, heads[projection])
        writer.add_tensor(
            gguf_tensor_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype
        )
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def llama3_rope_divisors(config) -> np.ndarray:
    """What llama.cpp stores as rope_freqs: default inverse frequencies / scaled ones."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    dims = torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim
    default = 1.0 / (config.rope_parameters["rope_theta"] ** dims)
    return (default / scaled.double()).numpy()


def test_gguf_llama_gqa_untied_with_llama3_rope(tmp_path: Path) -> None:
    model = tiny_model(
        "llama",
        257,
        rope_parameters=dict(LLAMA3_ROPE),
        hidden_size=128,
        max_position_embeddings=16384,
    )
    path = tmp_path / "llama.gguf"
    expected = write_model_gguf(path, model, "llama", llama3_rope_divisors(model.config))
    checkpoint = load_checkpoint(path, torch.float32)
    assert_config_matches(checkpoint, model.config)
    assert checkpoint.config.rope_scaling == RopeScaling(
        kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0
    )
    assert checkpoint.config.name == "tiny-llama" and checkpoint.config.eos_token_ids == (0,)
    assert set(checkpoint.weights) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(checkpoint.weights[name], value, rtol=0, atol=0, msg=name)
    q_proj = checkpoint.weights["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q_proj, torch.from_numpy(llama_cpp_permute(q_proj.numpy(), 4)))
    assert {storage_type(name, 128) for name in expected} >= {Q.Q4_1, Q.Q5_1, Q.BF16, Q.F16}


def test_gguf_qwen2_biases_tied_and_dtype(tmp_path: Path) -> None:
    model = tiny_model("qwen2", 257, tie_word_embeddings=True)
    path = tmp_path / "qwen2.gguf"
    expected = write_model_gguf(path, model, "qwen2")
    checkpoint = load_checkpoint(tmp_path, torch.bfloat16)  # a folder holding one GGUF file
    assert_config_matches(checkpoint, model.config)
    assert checkpoint.config.architecture == "qwen2" and checkpoint.config.attention_bias
    assert set(checkpoint.weights) == set(expected)
    assert "model.layers.1.self_attn.k_proj.bias" in expected
    for name, value in expected.items():
        assert checkpoint.weights[name].dtype == torch.bfloat16
        torch.testing.assert_close(checkpoint.weights[name], value.to(torch.bfloat16), msg=name)


# ---------------------------------------------------------------------------------------------
# safetensors folders written by transformers


@pytest.fixture(scope="module")
def tokenizer_files(
    default_checkpoint: LoadedCheckpoint, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    default_checkpoint.tokenizer.save(folder)
    return folder


def save_hf_folder(model, folder: Path, tokenizer_files: Path, **save_options) -> Path:
    model.generation_config.eos_token_id = [2, 0]
    model.save_pretrained(folder, **save_options)
    for file in tokenizer_files.iterdir():
        shutil.copy(file, folder / file.name)
    return folder


SAFETENSORS_CASES = {
    "llama-untied-gqa-llama3-rope": (
        "llama",
        {"rope_parameters": dict(LLAMA3_ROPE), "max_position_embeddings": 16384},
    ),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2-bias": ("qwen2", {}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 64}),
}


@pytest.mark.parametrize("case", list(SAFETENSORS_CASES))
def test_safetensors_folder(case: str, tokenizer_files: Path, tmp_path: Path) -> None:
    kind, overrides = SAFETENSORS_CASES[case]
    model = tiny_model(kind, 49152, **overrides)
    shards = {"max_shard_size": "2MB"} if kind == "qwen2" else {}
    folder = save_hf_folder(model, tmp_path / case, tokenizer_files, **shards)
    assert (folder / "model.safetensors.index.json").is_file() == bool(shards)
    checkpoint = load_checkpoint(folder, torch.float32)
    config = checkpoint.config
    assert config.architecture == kind
    assert config.attention_bias == (kind == "qwen2")
    assert config.eos_token_ids == (2, 0)
    if kind == "mistral":  # capped at the window, everything else as in config.json
        assert config.max_position_embeddings == 64
        model.config.max_position_embeddings = 64
    assert_config_matches(checkpoint, model.config)
    if "rope_parameters" in overrides:
        assert config.rope_scaling == RopeScaling(kind="llama3", factor=8.0)
    expected = hf_weights(model)
    assert set(checkpoint.weights) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(checkpoint.weights[name], value, rtol=0, atol=0, msg=name)
    assert checkpoint.tokenizer.encode("Hello world") == [19556, 905]


def test_legacy_rope_scaling_config(tokenizer_files: Path, tmp_path: Path) -> None:
    folder = save_hf_folder(tiny_model("llama", 49152), tmp_path / "legacy", tokenizer_files)
    config = json.loads((folder / "config.json").read_text())
    del config["rope_parameters"]
    config |= {"rope_theta": 1234.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    (folder / "config.json").write_text(json.dumps(config))
    checkpoint = load_checkpoint(folder, torch.float32)
    assert checkpoint.config.rope_theta == 1234.0
    assert checkpoint.config.rope_scaling == RopeScaling(kind="linear", factor=2.0)


# ---------------------------------------------------------------------------------------------
# bad input


@pytest.fixture(scope="module")
def good_folder(tokenizer_files: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("good")
    return save_hf_folder(tiny_model("llama", 49152), folder, tokenizer_files)


def broken_copy(good_folder: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "broken"
    shutil.copytree(good_folder, folder)
    return folder


def test_nonexistent_path() -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_checkpoint("/no/such/model", torch.float32)


def test_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="neither config.json"):
        load_checkpoint(tmp_path, torch.float32)


def test_not_a_model_file(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_checkpoint(tmp_path / "notes.txt", torch.float32)


def test_several_gguf_files(tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="several GGUF files"):
        load_checkpoint(tmp_path, torch.float32)


@pytest.mark.parametrize("size", ["half", "header", "random"])
def test_truncated_or_corrupt_gguf(tmp_path: Path, size: str) -> None:
    source = default_model_path()
    path = tmp_path / "broken.gguf"
    if size == "random":
        path.write_bytes(np.random.default_rng(0).bytes(1 << 16))
    else:
        with source.open("rb") as file:
            path.write_bytes(file.read(source.stat().st_size // 2 if size == "half" else 3000))
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_checkpoint(path, torch.float32)


def test_gguf_missing_tensor(tmp_path: Path) -> None:
    path = tmp_path / "partial.gguf"
    write_model_gguf(
        path, tiny_model("qwen2", 257), "qwen2", skip="model.layers.1.mlp.up_proj.weight"
    )
    with pytest.raises(ModelLoadError, match=r"1 tensors missing: model\.layers\.1\.mlp\.up_proj"):
        load_checkpoint(path, torch.float32)


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'phi3'"):
        load_checkpoint(tmp_path / "phi.gguf", torch.float32)


def test_random_bytes_safetensors(good_folder: Path, tmp_path: Path) -> None:
    folder = broken_copy(good_folder, tmp_path)
    (folder / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(5000))
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        load_checkpoint(folder, torch.float32)


def test_truncated_safetensors(good_folder: Path, tmp_path: Path) -> None:
    folder = broken_copy(good_folder, tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        load_checkpoint(folder, torch.float32)


def _rewrite_weights(folder: Path, edit) -> None:
    weights = hf_weights(tiny_model("llama", 49152))
    edit(weights)
    save_file(weights, folder / "model.safetensors")


def test_missing_tensor(good_folder: Path, tmp_path: Path) -> None:
    folder = broken_copy(good_folder, tmp_path)
    _rewrite_weights(folder, lambda weights: weights.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"1 tensors missing: model\.layers\.1\.mlp\.up_proj"):
        load_checkpoint(folder, torch.float32)


def test_wrong_shape(good_folder: Path, tmp_path: Path) -> None:
    folder = broken_copy(good_folder, tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite_weights(folder, lambda weights: weights.update({name: torch.zeros(16, 64)}))
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight is \(16, 64\), expected \(32, 64\)"):
        load_checkpoint(folder, torch.float32)


def test_unexpected_tensor(good_folder: Path, tmp_path: Path) -> None:
    folder = broken_copy(good_folder, tmp_path)
    _rewrite_weights(folder, lambda weights: weights.update({"model.extra.weight": torch.ones(2)}))
    with pytest.raises(ModelLoadError, match="unexpected tensors.*model.extra.weight"):
        load_checkpoint(folder, torch.float32)


def test_unsupported_architecture(good_folder: Path, tmp_path: Path) -> None:
    folder = broken_copy(good_folder, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_checkpoint(folder, torch.float32)
