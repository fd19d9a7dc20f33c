"""Tokenizer: GGUF-built tokenizers against transformers, chat templates, HF folders."""

from __future__ import annotations

import json
import random
from pathlib import Path

import gguf
import numpy as np
import pytest

from splitserve.common.errors import InvalidRequestError, ModelLoadError
from splitserve.common.gguf_file import GgufFile
from splitserve.common.model_files import default_model_path, load_tokenizer
from splitserve.common.prompt import min_prompt_tokens
from splitserve.common.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

SPACE = "\u2581"
TEXTS = [
    "Hello world",
    "  leading spaces",
    "trailing   ",
    "digits 1234567890 and 3.14159",
    "x=12+345",
    "emoji 😀👍🏽 family 👨‍👩‍👧",
    "日本語のテキスト",
    "Ünïcödé façade naïve",
    "code:\n\tdef f(x):\n        return x**2\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "tabs\t\tand\r\nnewlines\n\n\n",
    "",
    " ",
    "\n",
    "I'm you're they'll I'M",
    "a" * 50,
    "<|endoftext|>text<|endoftext|>",
    "mixed<|im_start|>inside",
    "URL https://example.com/a?b=1&c=2",
    "Ελληνικά и русский",
    "<repo_name>x<file_sep>",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 😀"},
    ],
]


@pytest.fixture(scope="module")
def default_gguf() -> GgufFile:
    return GgufFile(default_model_path())


@pytest.fixture(scope="module")
def ours(default_gguf: GgufFile) -> Tokenizer:
    return Tokenizer.from_gguf_fields(default_gguf)


@pytest.fixture(scope="module")
def reference(hf_default_tokenizer: object) -> object:
    return hf_default_tokenizer


def write_tokenizer_gguf(path: Path, model: str, tokens: list[str], types: list[int], **kw) -> Path:
    """A minimal llama-arch GGUF carrying a tokenizer (and one dummy tensor)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if "pre" in kw:
        writer.add_tokenizer_pre(kw["pre"])
    if "merges" in kw:
        writer.add_token_merges(kw["merges"])
    if "scores" in kw:
        writer.add_token_scores(kw["scores"])
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id)):
        if key in kw:
            add(kw[key])
    if "unk" in kw:
        writer.add_unk_token_id(kw["unk"])
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------------------------
# the default GGUF (SmolLM2, byte-level BPE, pre-tokenizer "smollm")


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(ours: Tokenizer, reference, text: str) -> None:
    ids = ours.encode(text)
    assert ids == reference.encode(text, add_special_tokens=True)
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == reference.decode(
        ids, skip_special_tokens=False
    )
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_smollm_isolates_every_digit_like_llama_cpp(ours: Tokenizer) -> None:
    # llama.cpp's "smollm" pre-tokenizer splits digits off first, then applies GPT-2's regex, so
    # the two spaces before "12" stay one pre-token. (transformers' GGUF path skips the digit
    # split and gives "Ġ", "Ġ", "1", ... here -- the only divergence we know of.)
    ids = ours.encode("  12  34 ")
    assert [ours.decode([i]) for i in ids] == ["  ", "1", "2", "  ", "3", "4", " "]


def test_special_tokens(ours: Tokenizer) -> None:
    assert ours.vocab_size == 49152
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)
    assert ours.all_special_ids == frozenset(range(17))  # every control token of the file
    assert ours.encode("<|im_start|>user")[:1] == [1]
    assert ours.encode("hi") == ours.encode("hi", add_special_tokens=False)  # add_bos is false
    assert ours.decode([1, *ours.encode("hi"), 2]) == "hi"
    assert ours.token_to_id("<|im_end|>") == 2


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: Tokenizer, reference, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    expected = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.apply_chat_template(messages, add_generation_prompt) == expected


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        ["not a dict"],
    ],
)
def test_chat_template_rejects_malformed_messages(ours: Tokenizer, messages: list) -> None:
    with pytest.raises(InvalidRequestError):
        ours.apply_chat_template(messages)


def test_save_round_trips_through_ours_and_transformers(ours: Tokenizer, tmp_path: Path) -> None:
    ours.save(tmp_path)
    again = Tokenizer.from_tokenizer_json(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert again.encode(text) == ours.encode(text) == hf.encode(text)
    assert again.all_special_ids == ours.all_special_ids
    assert again.chat_template == ours.chat_template
    messages = CONVERSATIONS[1]
    assert again.apply_chat_template(messages) == ours.apply_chat_template(messages)


# ---------------------------------------------------------------------------------------------
# HF folders: special-token flags and chat template sources


@pytest.fixture(scope="module")
def saved_folder(ours: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("saved")
    ours.save(folder)
    return folder


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _copy(folder: Path, target: Path) -> Path:
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).write_bytes((folder / name).read_bytes())
    return target


def test_add_bos_token_flag(saved_folder: Path, tmp_path: Path) -> None:
    folder = _copy(saved_folder, tmp_path / "bos")
    _edit_config(folder, bos_token={"content": "<|endoftext|>"}, add_bos_token=True)
    tokenizer = Tokenizer.from_tokenizer_json(folder)
    assert tokenizer.encode("hi")[0] == tokenizer.bos_token_id == 0
    assert tokenizer.encode("hi", add_special_tokens=False) == tokenizer.encode("hi")[1:]


def test_chat_template_file_precedence(saved_folder: Path, tmp_path: Path) -> None:
    folder = _copy(saved_folder, tmp_path / "templates")
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "json{{ bos_token }}"}))
    assert Tokenizer.from_tokenizer_json(folder).apply_chat_template(CONVERSATIONS[0]) == (
        "json<|im_start|>"
    )
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    assert Tokenizer.from_tokenizer_json(folder).apply_chat_template(CONVERSATIONS[0]) == "Hi there"


def test_chat_template_errors(saved_folder: Path, tmp_path: Path) -> None:
    folder = _copy(saved_folder, tmp_path / "errors")
    _edit_config(
        folder, chat_template=[{"name": "default", "template": "{{ raise_exception('no') }}"}]
    )
    with pytest.raises(InvalidRequestError, match="no"):
        Tokenizer.from_tokenizer_json(folder).apply_chat_template(CONVERSATIONS[0])
    _edit_config(folder, chat_template=None)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer.from_tokenizer_json(folder).apply_chat_template(CONVERSATIONS[0])
    _edit_config(folder, chat_template="{% for %}")
    with pytest.raises(ModelLoadError, match="does not compile"):
        Tokenizer.from_tokenizer_json(folder)


def test_folder_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_tokenizer_json(tmp_path)


def test_load_tokenizer_reads_only_metadata(sentencepiece_gguf: Path, saved_folder: Path) -> None:
    assert load_tokenizer(sentencepiece_gguf).encode("hello") == [1, 260]
    assert load_tokenizer(saved_folder).encode("Hello world") == [19556, 905]


# ---------------------------------------------------------------------------------------------
# other GGUF vocabularies, written here and compared with transformers' GGUF tokenizer


@pytest.fixture(scope="module")
def small_byte_level_vocab(default_gguf: GgufFile) -> tuple[list[str], list[int], list[str]]:
    """The first 6000 SmolLM2 tokens and the merges among them (ids unchanged): fast to load."""
    tokens = default_gguf.field("tokenizer.ggml.tokens")[:6000]
    types = default_gguf.field("tokenizer.ggml.token_type")[:6000]
    known = set(tokens)
    merges = [
        merge
        for merge in default_gguf.field("tokenizer.ggml.merges")
        if {*merge.split(" "), merge.replace(" ", "")} <= known
    ]
    return tokens, types, merges


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_byte_level_pre_tokenizers_match_transformers(
    small_byte_level_vocab: tuple[list[str], list[int], list[str]], tmp_path: Path, pre: str
) -> None:
    tokens, types, merges = small_byte_level_vocab
    path = write_tokenizer_gguf(
        tmp_path / f"{pre}.gguf", "gpt2", tokens, types, merges=merges, pre=pre, bos=1, eos=2
    )
    ours = Tokenizer.from_gguf_fields(GgufFile(path))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in [*TEXTS, "x=12+345  67 I'M", "12345678 987"]:
        assert ours.encode(text) == hf.encode(text), text


def test_unknown_pre_tokenizer_is_a_load_error(tmp_path: Path) -> None:
    path = write_tokenizer_gguf(
        tmp_path / "odd.gguf", "gpt2", ["a", "b"], [1, 1], merges=[], pre="made-up"
    )
    with pytest.raises(ModelLoadError, match="made-up"):
        Tokenizer.from_gguf_fields(GgufFile(path))


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pieces = [f"{SPACE}the", f"{SPACE}hello", f"{SPACE}world", f"{SPACE}t", "he", "ll", "llo"]
    pieces += [f"{SPACE}he", f"{SPACE}hel", f"{SPACE}w", "or", f"{SPACE}wor", "ld", "el"]
    chars = [SPACE, "t", "h", "e", "l", "o", "w", "r", "d"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, *chars]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) + len(chars))
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    scores += [-100.0 - i for i in range(len(chars))]
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    return write_tokenizer_gguf(path, "llama", tokens, types, scores=scores, bos=1, eos=2, unk=0)


def test_sentencepiece_gguf_matches_transformers(sentencepiece_gguf: Path) -> None:
    ours = Tokenizer.from_gguf_fields(GgufFile(sentencepiece_gguf))
    hf = transformers.AutoTokenizer.from_pretrained(
        sentencepiece_gguf.parent, gguf_file=sentencepiece_gguf.name
    )
    for text in ["the hello world", "hello", "Über the wörld!", "", "hello\nworld", "hel lo"]:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ids[0] == ours.bos_token_id == 1  # SentencePiece vocabularies add BOS by default
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True) == text


def test_sentencepiece_spaces_follow_llama_cpp(sentencepiece_gguf: Path) -> None:
    # llama.cpp (like sentencepiece) always prepends one space, also to text that starts with
    # one and after a special token; transformers' Metaspace does neither. We follow llama.cpp.
    ours = Tokenizer.from_gguf_fields(GgufFile(sentencepiece_gguf))
    hello = ours.token_to_id(f"{SPACE}hello")
    assert ours.encode(" hello", add_special_tokens=False) == [ours.token_to_id(SPACE), hello]
    assert ours.encode("<s>hello", add_special_tokens=False) == [1, hello]
    assert ours.decode(ours.encode(" hello  world")) == " hello  world"


def test_min_prompt_tokens_is_a_lower_bound_without_tokenizing() -> None:
    """``min_prompt_tokens`` never exceeds the real count (text of every kind, chat, ids) and
    grows with the text, so a prompt far over any context is known without tokenizing it."""
    tokenizer = load_tokenizer(default_model_path())
    per_token = tokenizer.max_chars_per_token
    assert per_token is not None and per_token > 1
    rng = random.Random(0)
    alphabet = "abc xyz 0123456789 \n\t#-=é中文🙂" + "".join(chr(c) for c in range(33, 127))
    texts = ["#" * 5000, " " * 3000, "\n" + " " * 400, "hello world " * 300]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4000))) for _ in range(30)]
    for text in texts:
        assert 1 <= min_prompt_tokens(tokenizer, text) <= len(tokenizer.encode(text)), text[:40]
    chat = [{"role": "user", "content": "#" * 900}, {"role": "assistant", "content": "ok"}]
    rendered = tokenizer.encode(tokenizer.apply_chat_template(chat))
    assert 1 <= min_prompt_tokens(tokenizer, chat) <= len(rendered)
    assert min_prompt_tokens(tokenizer, [5, 6, 7]) == 3
    assert min_prompt_tokens(tokenizer, "x" * (per_token * 10_000)) == 10_000


def test_chat_template_variables_and_a_continued_final_message(
    ours: Tokenizer, saved_folder: Path, tmp_path: Path
) -> None:
    """vLLM's ``chat_template_kwargs`` reach the template (never over the names it is given),
    and its ``documents`` where the template reads them (refused where it does not);
    ``continue_final_message`` ends the text with the assistant's content, open (SmolLM2's
    template would close it with ``<|im_end|>``)."""
    folder = _copy(saved_folder, tmp_path / "kwargs")
    _edit_config(
        folder,
        chat_template="{% if enable_thinking %}<think>{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}{{ '-' * (depth or 0) }}",
    )
    templated = Tokenizer.from_tokenizer_json(folder)
    messages = [{"role": "user", "content": "Hi"}]
    assert templated.apply_chat_template(messages) == "Hi"
    assert templated.apply_chat_template(messages, template_kwargs={"enable_thinking": True}) == (
        "<think>Hi"
    )
    for reserved in ("messages", "bos_token", "add_generation_prompt", "raise_exception", "range"):
        with pytest.raises(InvalidRequestError) as refused:
            templated.apply_chat_template(messages, template_kwargs={reserved: 1})
        assert refused.value.param == "chat_template_kwargs" and reserved in refused.value.message
    with pytest.raises(InvalidRequestError) as refused:  # a value the template cannot use
        templated.apply_chat_template(messages, template_kwargs={"depth": "deep"})
    assert refused.value.param == "chat_template_kwargs"
    assert templated.apply_chat_template(messages, template_kwargs={"depth": 2}) == "Hi--"

    with pytest.raises(InvalidRequestError) as refused:  # this template reads no documents
        templated.apply_chat_template(messages, template_kwargs={"documents": [{"text": "x"}]})
    assert refused.value.param == "documents"
    grounded = _copy(saved_folder, tmp_path / "documents")
    _edit_config(  # as retrieval-augmented templates (Command R's, Granite's) read them
        grounded,
        chat_template="{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}",
    )
    documents = [{"title": "Paris", "text": "capital of France"}, {"title": "Rome", "text": "?"}]
    assert (
        Tokenizer.from_tokenizer_json(grounded).apply_chat_template(
            messages, template_kwargs={"documents": documents}
        )
        == "[Paris: capital of France][Rome: ?]Hi"
    )
    with pytest.raises(InvalidRequestError) as refused:  # nor a reasoning effort
        templated.apply_chat_template(messages, template_kwargs={"reasoning_effort": "low"})
    assert refused.value.param == "reasoning_effort"
    effort = Tokenizer.from_tokenizer_json(grounded).with_chat_template(
        "Reasoning: {{ reasoning_effort }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    )  # as gpt-oss's template reads it
    assert effort.apply_chat_template(messages, template_kwargs={"reasoning_effort": "high"}) == (
        "Reasoning: high|Hi"
    )

    prefilled = [*messages, {"role": "assistant", "content": "The answer is "}]
    closed = ours.apply_chat_template(prefilled, add_generation_prompt=False)
    assert closed.endswith("The answer is <|im_end|>\n")
    opened = ours.apply_chat_template(prefilled, False, continue_final_message=True)
    assert opened == closed[: closed.rindex("The answer is") + len("The answer is")]
    for bad_messages, generation_prompt in ((prefilled, True), (messages, False)):
        with pytest.raises(InvalidRequestError) as refused:
            ours.apply_chat_template(bad_messages, generation_prompt, continue_final_message=True)
        assert refused.value.param == "continue_final_message"
