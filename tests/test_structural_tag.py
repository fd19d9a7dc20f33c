"""Structural tags (``common/structural_tag.py``): each format accepts the texts xgrammar's
documentation says it matches and rejects the others, fed token by token to llguidance's
matcher over the default model's tokenizer; forms this server does not serve are refused
naming ``structured_outputs``; the in-process engine's outputs follow a structural tag."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from splitserve.common.errors import InvalidRequestError
from splitserve.common.grammar import GrammarCompiler, GrammarSpec
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.checkpoint import LoadedCheckpoint
from tests.conftest import assert_no_leaks, constraint_takes, make_llm

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_TAG = {
    "type": "tag",
    "begin": "<function=get_weather>",
    "content": {"type": "json_schema", "json_schema": CITY},
    "end": "</function>",
}
TIME_TAG = {
    "type": "tag",
    "begin": "<function=get_time>",
    "content": {"type": "json_schema", "json_schema": {"type": "object"}},
    "end": "</function>",
}
TOOLS = {"type": "triggered_tags", "triggers": ["<function="], "tags": [WEATHER_TAG, TIME_TAG]}
THINK = {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"}
ITEMS = {
    "type": "tags_with_separator",
    "separator": ",",
    "tags": [{"begin": "<i>", "content": {"type": "regex", "pattern": "[0-9]+"}, "end": "</i>"}],
}
CALL = '<function=get_weather>{"city": "Paris"}</function>'

# (format, text, whether the format matches the text)
CASES: list[tuple[dict[str, Any], str, bool]] = [
    (TOOLS, f"I will look. {CALL} Done.", True),
    (TOOLS, "No tool is needed.", True),
    (TOOLS, f'{CALL}<function=get_time>{{"tz": 1}}</function>', True),
    (TOOLS, "<function=get_date>{}</function>", False),  # no such tag
    (TOOLS, '<function=get_weather>{"town": "Paris"}</function>', False),  # its schema
    (TOOLS, "text <function=get_weather>no json", False),  # a trigger must dispatch
    ({**TOOLS, "at_least_one": True}, f"{CALL} then text", True),
    ({**TOOLS, "at_least_one": True}, f"text first {CALL}", False),
    ({**TOOLS, "at_least_one": True}, "only text", False),
    ({**TOOLS, "stop_after_first": True}, f"Looking. {CALL}", True),
    ({**TOOLS, "stop_after_first": True}, f"Looking. {CALL} more", False),
    ({**TOOLS, "excludes": ["secret"]}, "a secret", False),
    (THINK, "<think>step one, step two</think>", True),
    (THINK, "<think>unclosed", False),
    (
        {
            "type": "sequence",
            "elements": [
                THINK,
                {"type": "const_string", "value": "A: "},
                {"type": "json_schema", "json_schema": CITY},
            ],
        },
        '<think>hmm</think>A: {"city": "Rome"}',
        True,
    ),  # fmt: skip
    (
        {"type": "sequence", "elements": [THINK, {"type": "const_string", "value": "A"}]},
        "<think>x</think>y</think>A",
        False,
    ),  # fmt: skip  (the first end closes the region)
    (ITEMS, "<i>1</i>,<i>22</i>", True),
    (ITEMS, "", True),
    (ITEMS, "<i>1</i><i>2</i>", False),
    ({**ITEMS, "at_least_one": True}, "", False),
    ({**ITEMS, "stop_after_first": True}, "<i>1</i>,<i>2</i>", False),
    (
        {
            "type": "or",
            "elements": [
                {"type": "const_string", "value": "yes"},
                {"type": "grammar", "grammar": 'root ::= "no" | "nah"'},
            ],
        },
        "nah",
        True,
    ),  # fmt: skip
    ({"type": "grammar", "grammar": 'start: "a" B\nB: /[0-9]/'}, "a7", True),
    (
        {"type": "repeat", "min": 2, "max": 3, "content": {"type": "const_string", "value": "ab"}},
        "ababab",
        True,
    ),  # fmt: skip
    (
        {"type": "repeat", "min": 2, "max": 3, "content": {"type": "const_string", "value": "ab"}},
        "ab",
        False,
    ),  # fmt: skip
    ({"type": "star", "content": {"type": "const_string", "value": "x"}}, "xxx", True),
    ({"type": "plus", "content": {"type": "const_string", "value": "x"}}, "", False),
    ({"type": "optional", "content": {"type": "const_string", "value": "x"}}, "", True),
    (
        {
            "type": "tag",
            "begin": "<a>",
            "content": {"type": "any_text", "excludes": ["bad"]},
            "end": ["</a>", "</b>"],
        },
        "<a>good</b>",
        True,
    ),  # fmt: skip
    (
        {
            "type": "tag",
            "begin": "<a>",
            "content": {"type": "any_text", "excludes": ["bad"]},
            "end": ["</a>", "</b>"],
        },
        "<a>a bad one</a>",
        False,
    ),  # fmt: skip
    (
        {
            "type": "tag",
            "begin": "<a>",
            "content": {"type": "any_text", "max_chars": 3},
            "end": "</a>",
        },
        "<a>abc</a>",
        True,
    ),  # fmt: skip
    (
        {
            "type": "tag",
            "begin": "<a>",
            "content": {"type": "any_text", "max_chars": 3},
            "end": "</a>",
        },
        "<a>abcd</a>",
        False,
    ),  # fmt: skip
    ({"type": "regex", "pattern": "a/b[0-9]"}, "a/b7", True),
    ({"type": "tag", "begin": "<t>", "content": TOOLS, "end": "</t>"}, f"<t>a {CALL} b</t>", True),
    ({"type": "tag", "begin": "<t>", "content": TOOLS, "end": "</t>"}, "<t>a</t>b", False),
]


@pytest.mark.parametrize(("fmt", "text", "holds"), CASES)
def test_each_format_matches_what_it_describes(
    compiler: GrammarCompiler, fmt: dict[str, Any], text: str, holds: bool
) -> None:
    spec = GrammarSpec.structural_tag({"type": "structural_tag", "format": fmt})
    assert constraint_takes(compiler, spec, text) is holds


def test_vllms_structures_and_triggers_read_as_triggered_tags(compiler: GrammarCompiler) -> None:
    legacy = {
        "type": "structural_tag",
        "structures": [{"begin": "<function=get_weather>", "schema": CITY, "end": "</function>"}],
        "triggers": ["<function="],
    }
    spec = GrammarSpec.structural_tag(json.dumps(legacy))  # vLLM sends it as JSON text
    assert constraint_takes(compiler, spec, f"Sure. {CALL} Done.")
    assert not constraint_takes(compiler, spec, "<function=get_time>{}</function>")


@pytest.mark.parametrize(
    ("tag", "says"),
    [
        ("{not json", "not JSON"),
        ({"type": "json_schema"}, "type must be 'structural_tag'"),
        ({"type": "structural_tag"}, "give format"),
        ({"format": {"type": "token", "token": "<x>"}}, "token format is not supported"),
        ({"format": {"type": "dispatch", "rules": []}}, "dispatch format is not supported"),
        ({"format": {"type": "mystery"}}, "unknown format type"),
        ({"format": {"type": "const_string", "value": "a", "extra": 1}}, "no field 'extra'"),
        ({"format": {"type": "json_schema", "json_schema": {}, "style": "qwen_xml"}}, "style"),
        ({"format": {"type": "json_schema", "json_schema": {}, "any_order": True}}, "any_order"),
        ({"format": {"type": "any_text", "max_tokens": 5}}, "max_tokens is not supported"),
        (
            {
                "format": {
                    "type": "tag",
                    "begin": {"token": "<x>"},
                    "content": {"type": "any_text"},
                    "end": "</x>",
                }
            },
            "token ones are not supported",
        ),  # fmt: skip
        ({"format": {**TOOLS, "triggers": ["<tool="]}}, "starts with no trigger"),
        ({"format": {**TOOLS, "triggers": ["<function=", "<call>"]}}, "no tag begins with"),
        ({"format": {"type": "regex", "pattern": "(unclosed"}}, "pattern"),
        ({"format": {"type": "repeat", "min": 3, "max": 2, "content": THINK}}, "max must be"),
        (
            {
                "format": {
                    "type": "sequence",
                    "elements": [{"type": "any_text"}, {"type": "const_string", "value": "x"}],
                }
            },
            "free text must end the output",
        ),  # fmt: skip
        ({"format": {"type": "star", "content": TOOLS}}, "triggered_tags must end the output"),
        (
            {
                "format": {
                    "type": "sequence",
                    "elements": [{"type": "const_string", "value": "a"}] * 1025,
                }
            },
            "more than 1024 formats",
        ),  # fmt: skip
    ],
)
def test_a_form_not_served_is_refused_by_name(
    compiler: GrammarCompiler, tag: dict[str, Any] | str, says: str
) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        compiler.compile(GrammarSpec.structural_tag(tag))
    assert refused.value.param == "structured_outputs"
    assert says in refused.value.message, refused.value.message


def test_nesting_past_the_bound_is_refused(compiler: GrammarCompiler) -> None:
    fmt: dict[str, Any] = {"type": "const_string", "value": "x"}
    for _ in range(40):
        fmt = {"type": "optional", "content": fmt}
    with pytest.raises(InvalidRequestError, match="nested deeper than 32"):
        GrammarSpec.structural_tag({"format": fmt})


def test_the_engine_output_follows_a_structural_tag(
    default_checkpoint_fp32: LoadedCheckpoint,
) -> None:
    """Greedy and sampled (float32, in process): a reasoning region, then an answer forced
    into a tag of a JSON schema; the output parses as the format says and the request ends."""
    llm = make_llm(default_checkpoint_fp32)
    bounded_think = {**THINK, "content": {"type": "any_text", "max_chars": 16}}
    fmt = {
        "type": "sequence",
        "elements": [bounded_think, {**WEATHER_TAG, "begin": "<answer>", "end": "</answer>"}],
    }
    spec = GrammarSpec.structural_tag({"type": "structural_tag", "format": fmt})
    shape = re.compile(r"<think>(?s:(.{0,16}?))</think><answer>(\{.*\})</answer>")
    for temperature in (0.0, 0.8):
        params = SamplingParams(max_tokens=80, temperature=temperature, seed=7, grammar=spec)
        (result,) = llm.generate(["What is the weather in Paris?"], params)
        matched = shape.fullmatch(result.text)
        assert result.finish_reason.value == "stop" and matched, result.text
        assert set(json.loads(matched.group(2))) == {"city"}
    assert_no_leaks(llm)
