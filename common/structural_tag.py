"""Structural tags: an output described as a tree of formats (xgrammar's ``structural_tag``,
as vLLM and SGLang take it), parsed into typed formats and compiled to llguidance's Lark.

Two request forms are read (``parse_structural_tag``):
- xgrammar's: ``{"type": "structural_tag", "format": FORMAT}`` (the ``type`` may be absent);
- vLLM's older one: ``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}],
  "triggers": [...]}``, read as a ``triggered_tags`` of those tags.

FORMAT is one of (``type``; fields as xgrammar names them):
- ``const_string`` (``value``), ``json_schema`` (``json_schema``; ``style`` ``"json"`` only),
  ``regex`` (``pattern``), ``grammar`` (``grammar``: GBNF/EBNF with a ``root`` rule, or Lark
  with ``start``), ``any_text`` (``excludes``, ``max_chars``);
- ``sequence`` / ``or`` (``elements``), ``optional`` / ``plus`` / ``star`` (``content``),
  ``repeat`` (``min``, ``max``; ``-1`` for no bound);
- ``tag`` (``begin``, ``content``, ``end``: a string or a list of strings);
- ``triggered_tags`` (``triggers``, ``tags``, ``at_least_one``, ``stop_after_first``,
  ``excludes``): free text until a trigger, then one of the tags whose ``begin`` starts with
  it, then free text again;
- ``tags_with_separator`` (``tags``, ``separator``, ``at_least_one``, ``stop_after_first``).

Refused with ``InvalidRequestError`` naming ``structured_outputs`` (never ignored): the
token-level formats and ``dispatch``, a non-JSON ``style``, ``any_order``, ``any_text``'s
``max_tokens``, a begin or end given as a token, an unknown field, a trigger no tag begins with
(or a tag no trigger begins), more than ``MAX_FORMATS`` formats or ``MAX_DEPTH`` levels.

Invariant on where free text ends: a format that can run on without bound (``any_text``,
even with ``max_chars``; ``triggered_tags`` not stopped after its first tag) must either end the
whole output (it then runs to the end of generation) or be where an enclosing ``tag``'s end
follows it, as that tag's content, the last element of its sequence, or an alternative of it;
the end then stops it (the first occurrence of the end closes the region, as in xgrammar).
Elsewhere (followed by another element, repeated) it is refused: nothing could tell where it
stops.

JSON inside a structural tag is laid out as every JSON output here (``grammar.JSON_LAYOUT``)
unless its schema's own ``x-guidance`` says otherwise.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from splitserve.common.errors import InvalidRequestError

MAX_FORMATS = 1024
"""Most formats one structural tag may hold (a thousand tools' tags is already past useful)."""
MAX_DEPTH = 32
"""Deepest nesting of formats accepted."""
PARAM = "structured_outputs"


def _refuse(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"invalid structural_tag: {message}", PARAM)


@dataclass(frozen=True)
class ConstString:
    value: str


@dataclass(frozen=True)
class JsonSchema:
    schema: dict[str, Any] | bool


@dataclass(frozen=True)
class Regex:
    pattern: str


@dataclass(frozen=True)
class Grammar:
    text: str


@dataclass(frozen=True)
class AnyText:
    excludes: tuple[str, ...] = ()
    max_chars: int | None = None


@dataclass(frozen=True)
class Sequence:
    elements: tuple[Format, ...]


@dataclass(frozen=True)
class Or:
    elements: tuple[Format, ...]


@dataclass(frozen=True)
class Repeat:
    """``content`` between ``least`` and ``most`` times (``most`` None: no bound); optional,
    plus and star are repeats."""

    content: Format
    least: int
    most: int | None


@dataclass(frozen=True)
class Tag:
    begin: str
    content: Format
    ends: tuple[str, ...]


@dataclass(frozen=True)
class TriggeredTags:
    triggers: tuple[str, ...]
    tags: tuple[Tag, ...]
    at_least_one: bool = False
    stop_after_first: bool = False
    excludes: tuple[str, ...] = ()


@dataclass(frozen=True)
class TagsWithSeparator:
    tags: tuple[Tag, ...]
    separator: str
    at_least_one: bool = False
    stop_after_first: bool = False


Format = (
    ConstString | JsonSchema | Regex | Grammar | AnyText | Sequence | Or | Repeat | Tag
    | TriggeredTags | TagsWithSeparator
)  # fmt: skip

_TOKEN_LEVEL = ("token", "exclude_token", "any_tokens", "token_triggered_tags", "token_dispatch")


def parse_structural_tag(value: Any) -> Format:
    """The request's structural tag (a JSON object, or its JSON text) as typed formats;
    ``InvalidRequestError`` for anything this module's docstring does not accept."""
    return _Reader().format(structural_tag_format(value), "format", 0)


def structural_tag_format(value: Any) -> dict[str, Any]:
    """The request's structural tag's format object (vLLM's older form as the
    ``triggered_tags`` it means), not yet read; ``InvalidRequestError`` for a tag of neither
    form."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise _refuse(f"not JSON ({error})") from None
    if not isinstance(value, dict):
        raise _refuse("expected an object")
    kind = value.get("type", "structural_tag")
    if kind != "structural_tag":
        raise _refuse(f"type must be 'structural_tag', not {kind!r}")
    if "format" in value:
        _fields(value, {"type", "format"}, "structural_tag")
        return value["format"]
    if "structures" in value:
        _fields(value, {"type", "structures", "triggers"}, "structural_tag")
        return _legacy_format(value)
    raise _refuse("give format (or structures and triggers)")


def _legacy_format(value: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``structures`` and ``triggers`` as the ``triggered_tags`` format they mean."""
    structures = value["structures"]
    if not isinstance(structures, list) or not structures:
        raise _refuse("structures must be a non-empty list")
    tags = []
    for index, item in enumerate(structures):
        where = f"structures[{index}]"
        if not isinstance(item, dict):
            raise _refuse(f"{where} must be an object")
        _fields(item, {"begin", "schema", "structural_tag_schema", "end"}, where)
        schema = item.get("schema", item.get("structural_tag_schema"))
        if not isinstance(schema, dict | bool):
            raise _refuse(f"{where}.schema must be a JSON schema")
        tags.append({
            "type": "tag",
            "begin": _string(item.get("begin"), f"{where}.begin"),
            "content": {"type": "json_schema", "json_schema": schema},
            "end": _string(item.get("end"), f"{where}.end"),
        })  # fmt: skip
    triggers = _strings(value.get("triggers"), "triggers")
    return {"type": "triggered_tags", "triggers": list(triggers), "tags": tags}


def _fields(value: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise _refuse(f"{where} has no field {unknown[0]!r} (it takes {sorted(allowed)})")


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _refuse(f"{where} must be a string")
    return value


def _strings(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _refuse(f"{where} must be a list of strings")
    return tuple(value)


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _refuse(f"{where} must be true or false")
    return value


def _count(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _refuse(f"{where} must be a non-negative integer")
    return value


@dataclass
class _Reader:
    """Reads formats, counting them against ``MAX_FORMATS``."""

    formats: int = 0

    def _counted(self, made: Format) -> Format:
        self.formats += 1
        if self.formats > MAX_FORMATS:
            raise _refuse(f"more than {MAX_FORMATS} formats")
        return made

    def format(self, value: Any, where: str, depth: int) -> Format:
        if depth > MAX_DEPTH:
            raise _refuse(f"nested deeper than {MAX_DEPTH} levels at {where}")
        if not isinstance(value, dict):
            raise _refuse(f"{where} must be a format object")
        kind = value.get("type")
        read = _READERS.get(kind) if isinstance(kind, str) else None
        if read is None:
            if kind in _TOKEN_LEVEL or kind == "dispatch":
                raise _refuse(f"{where}: the {kind} format is not supported")
            raise _refuse(f"{where}: unknown format type {kind!r}")
        allowed, method = read
        _fields(value, {"type", *allowed}, f"{where} ({kind})")
        return self._counted(method(self, value, where, depth + 1))

    def _const_string(self, value: dict[str, Any], where: str, depth: int) -> Format:
        return ConstString(_string(value.get("value"), f"{where}.value"))

    def _json_schema(self, value: dict[str, Any], where: str, depth: int) -> Format:
        schema = value.get("json_schema")
        if not isinstance(schema, dict | bool):
            raise _refuse(f"{where}.json_schema must be a JSON schema")
        if value.get("style", "json") != "json":
            raise _refuse(f"{where}.style {value['style']!r} is not supported (only 'json')")
        if value.get("any_order", False) is not False:
            raise _refuse(f"{where}.any_order is not supported")
        return JsonSchema(schema)

    def _regex(self, value: dict[str, Any], where: str, depth: int) -> Format:
        pattern = _string(value.get("pattern"), f"{where}.pattern")
        try:
            re.compile(pattern)
        except re.error as error:
            raise _refuse(f"{where}.pattern: {error}") from None
        return Regex(pattern)

    def _grammar(self, value: dict[str, Any], where: str, depth: int) -> Format:
        return Grammar(_string(value.get("grammar"), f"{where}.grammar"))

    def _any_text(self, value: dict[str, Any], where: str, depth: int) -> Format:
        if value.get("max_tokens") is not None:
            raise _refuse(f"{where}.max_tokens is not supported (max_chars is)")
        excludes = _strings(value.get("excludes", []), f"{where}.excludes")
        if any(not exclude for exclude in excludes):
            raise _refuse(f"{where}.excludes holds an empty string")
        limit = value.get("max_chars")
        return AnyText(excludes, None if limit is None else _count(limit, f"{where}.max_chars"))

    def _elements(self, value: dict[str, Any], where: str, depth: int) -> tuple[Format, ...]:
        elements = value.get("elements")
        if not isinstance(elements, list) or not elements:
            raise _refuse(f"{where}.elements must be a non-empty list of formats")
        return tuple(
            self.format(item, f"{where}.elements[{index}]", depth)
            for index, item in enumerate(elements)
        )

    def _sequence(self, value: dict[str, Any], where: str, depth: int) -> Format:
        return Sequence(self._elements(value, where, depth))

    def _or(self, value: dict[str, Any], where: str, depth: int) -> Format:
        return Or(self._elements(value, where, depth))

    def _content(self, value: dict[str, Any], where: str, depth: int) -> Format:
        return self.format(value.get("content"), f"{where}.content", depth)

    def _optional(self, value: dict[str, Any], where: str, depth: int) -> Format:
        return Repeat(self._content(value, where, depth), 0, 1)

    def _plus(self, value: dict[str, Any], where: str, depth: int) -> Format:
        return Repeat(self._content(value, where, depth), 1, None)

    def _star(self, value: dict[str, Any], where: str, depth: int) -> Format:
        return Repeat(self._content(value, where, depth), 0, None)

    def _repeat(self, value: dict[str, Any], where: str, depth: int) -> Format:
        least = _count(value.get("min"), f"{where}.min")
        most = value.get("max")
        if most == -1:
            return Repeat(self._content(value, where, depth), least, None)
        most = _count(most, f"{where}.max")
        if most < least or most == 0:
            raise _refuse(f"{where}: max must be -1 or at least max(min, 1)")
        return Repeat(self._content(value, where, depth), least, most)

    def _tag(self, value: dict[str, Any], where: str, depth: int) -> Format:
        begin, end = value.get("begin"), value.get("end")
        if not isinstance(begin, str) or not isinstance(end, str | list):
            raise _refuse(f"{where}: begin and end must be strings (token ones are not supported)")
        ends = (end,) if isinstance(end, str) else _strings(end, f"{where}.end")
        if not ends or (len(ends) > 1 and "" in ends):
            raise _refuse(f"{where}.end must be a string or a list of non-empty strings")
        return Tag(begin, self._content(value, where, depth), ends)

    def _tags(self, value: dict[str, Any], where: str, depth: int) -> tuple[Tag, ...]:
        tags = value.get("tags")
        if not isinstance(tags, list) or not tags:
            raise _refuse(f"{where}.tags must be a non-empty list of tags")
        read = []
        for index, item in enumerate(tags):
            if not isinstance(item, dict) or item.get("type", "tag") != "tag":
                raise _refuse(f"{where}.tags[{index}] must be a tag")
            item = {"type": "tag", **item}
            read.append(self.format(item, f"{where}.tags[{index}]", depth))
        return tuple(tag for tag in read if isinstance(tag, Tag))

    def _triggered_tags(self, value: dict[str, Any], where: str, depth: int) -> Format:
        return self._triggered(
            _strings(value.get("triggers"), f"{where}.triggers"),
            self._tags(value, where, depth),
            _bool(value.get("at_least_one", False), f"{where}.at_least_one"),
            _bool(value.get("stop_after_first", False), f"{where}.stop_after_first"),
            _strings(value.get("excludes", []), f"{where}.excludes"),
            where,
        )

    def _triggered(
        self,
        triggers: tuple[str, ...],
        tags: tuple[Tag, ...],
        at_least_one: bool,
        stop_after_first: bool,
        excludes: tuple[str, ...],
        where: str,
    ) -> Format:
        if not triggers or any(not trigger for trigger in triggers):
            raise _refuse(f"{where}.triggers must be a non-empty list of non-empty strings")
        for tag in tags:
            if _trigger_of(tag, triggers) is None:
                raise _refuse(f"{where}: the tag beginning {tag.begin!r} starts with no trigger")
        for trigger in triggers:
            if not any(tag.begin.startswith(trigger) for tag in tags):
                raise _refuse(f"{where}: no tag begins with the trigger {trigger!r}")
        if any(not exclude for exclude in excludes):
            raise _refuse(f"{where}.excludes holds an empty string")
        return TriggeredTags(triggers, tags, at_least_one, stop_after_first, excludes)

    def _tags_with_separator(self, value: dict[str, Any], where: str, depth: int) -> Format:
        return TagsWithSeparator(
            self._tags(value, where, depth),
            _string(value.get("separator"), f"{where}.separator"),
            _bool(value.get("at_least_one", False), f"{where}.at_least_one"),
            _bool(value.get("stop_after_first", False), f"{where}.stop_after_first"),
        )


_READERS = {
    "const_string": ({"value"}, _Reader._const_string),
    "json_schema": ({"json_schema", "style", "any_order"}, _Reader._json_schema),
    "regex": ({"pattern"}, _Reader._regex),
    "grammar": ({"grammar"}, _Reader._grammar),
    "any_text": ({"excludes", "max_tokens", "max_chars"}, _Reader._any_text),
    "sequence": ({"elements"}, _Reader._sequence),
    "or": ({"elements"}, _Reader._or),
    "optional": ({"content"}, _Reader._optional),
    "plus": ({"content"}, _Reader._plus),
    "star": ({"content"}, _Reader._star),
    "repeat": ({"content", "min", "max"}, _Reader._repeat),
    "tag": ({"begin", "content", "end"}, _Reader._tag),
    "triggered_tags": (
        {"triggers", "tags", "at_least_one", "stop_after_first", "excludes"},
        _Reader._triggered_tags,
    ),
    "tags_with_separator": (
        {"tags", "separator", "at_least_one", "stop_after_first"},
        _Reader._tags_with_separator,
    ),
}


def _trigger_of(tag: Tag, triggers: tuple[str, ...]) -> str | None:
    """The longest trigger ``tag``'s begin starts with (None: none does)."""
    matching = [trigger for trigger in triggers if tag.begin.startswith(trigger)]
    return max(matching, key=len) if matching else None


# --- compilation to llguidance's Lark ------------------------------------------------------


def _literal(text: str) -> str:
    return json.dumps(text)


def _regex_body(pattern: str) -> str:
    """``pattern`` as a Lark ``/.../`` regex (its slashes escaped)."""
    return "/" + re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", pattern) + "/"


def _alternation(texts: tuple[str, ...]) -> str:
    return "(?:" + "|".join(re.escape(text) for text in texts) + ")"


_ANY = "(?s:.*)"


@dataclass
class _Compiler:
    """Lark rules for a format tree; each rule's name is fresh (``f<n>`` / ``T<n>``)."""

    layout: dict[str, Any]
    rules: list[str] = field(default_factory=list)
    grammars: list[dict[str, Any]] = field(default_factory=list)
    count: int = 0

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def rule(self, body: str, options: str = "") -> str:
        name = self.fresh("f")
        self.rules.append(f"{name}{options}: {body}")
        return name

    def terminal(self, body: str) -> str:
        name = self.fresh("T")
        self.rules.append(f"{name}: {body}")
        return name

    def free_text(self, excludes: tuple[str, ...], max_chars: int | None = None) -> str:
        """A terminal for free text without any of ``excludes``, of at most ``max_chars``."""
        body = _regex_body(_ANY if max_chars is None else f"(?s:.{{0,{max_chars}}})")
        if excludes:
            body += " & ~" + _regex_body(f"{_ANY}{_alternation(excludes)}{_ANY}")
        return self.terminal(body)

    def stop_terminal(self, ends: tuple[str, ...]) -> str:
        return _literal(ends[0]) if len(ends) == 1 else _regex_body(_alternation(ends))

    def compile(self, fmt: Format, stop: tuple[str, ...] | None, at_end: bool, where: str) -> str:
        """A Lark expression matching ``fmt`` followed by one of ``stop`` (when given); an
        unbounded format takes the stop as where it ends, or, ``at_end``, the generation's
        end; elsewhere it is refused (module docstring)."""
        if isinstance(fmt, AnyText):
            return self._free_region(fmt, stop, at_end, where)
        if isinstance(fmt, TriggeredTags) and not fmt.stop_after_first:
            return self._triggered(fmt, stop, at_end, where)
        if isinstance(fmt, Sequence):
            last = len(fmt.elements) - 1
            return " ".join(
                self.compile(
                    element,
                    stop if index == last else None,
                    at_end and index == last,
                    f"{where}.elements[{index}]",
                )
                for index, element in enumerate(fmt.elements)
            )
        if isinstance(fmt, Or):
            branches = [
                self.compile(element, stop, at_end, f"{where}.elements[{index}]")
                for index, element in enumerate(fmt.elements)
            ]
            return self.rule(" | ".join(branches))
        if isinstance(fmt, Repeat) and fmt.least == 0 and fmt.most == 1:
            inner = self.compile(fmt.content, stop, at_end, f"{where}.content")
            ended = self.stop_terminal(stop) if stop else ""
            return self.rule(f"{inner} | {ended}" if ended else f"({inner})?")
        return f"{self._bounded(fmt, where)} {self.stop_terminal(stop) if stop else ''}".strip()

    def _bounded(self, fmt: Format, where: str) -> str:
        """A Lark expression matching ``fmt``, which ends by itself."""
        if isinstance(fmt, ConstString):
            return _literal(fmt.value) if fmt.value else '""'
        if isinstance(fmt, JsonSchema):
            schema = fmt.schema
            if isinstance(schema, dict) and "x-guidance" not in schema:
                schema = {**schema, "x-guidance": self.layout}
            return self.rule("%json " + json.dumps(schema))
        if isinstance(fmt, Regex):
            return self.rule(self.terminal(_regex_body(fmt.pattern)))
        if isinstance(fmt, Grammar):
            return self._grammar(fmt.text)
        if isinstance(fmt, Repeat):
            inner = self.compile(fmt.content, None, False, f"{where}.content")
            most = "" if fmt.most is None else str(fmt.most)
            return self.rule(f"({inner}){{{fmt.least},{most}}}")
        if isinstance(fmt, Tag):
            return self._tag(fmt, where)
        if isinstance(fmt, TriggeredTags):  # stopped after its first tag
            return self._triggered(fmt, None, False, where)
        if isinstance(fmt, TagsWithSeparator):
            return self._separated(fmt, where)
        return self.compile(fmt, None, False, where)  # a sequence, an or, an optional

    def _tag(self, tag: Tag, where: str, begin: str | None = None) -> str:
        """``begin content end`` (``begin`` given: the rest of the tag's begin, its trigger
        already matched)."""
        head = tag.begin if begin is None else begin
        content = self.compile(tag.content, tag.ends, False, f"{where}.content")
        return self.rule(f"{_literal(head) if head else ''} {content}".strip())

    def _grammar(self, text: str) -> str:
        from llguidance import grammar_from

        try:
            lark = grammar_from("grammar", text)  # GBNF is rewritten as Lark; Lark as is
        except ValueError as error:
            raise _refuse(f"grammar: {error}") from None
        name = self.fresh("g")
        self.grammars.append({"name": name, "lark_grammar": lark})
        return self.rule(f"@{name}")

    def _free_region(
        self, fmt: AnyText, stop: tuple[str, ...] | None, at_end: bool, where: str
    ) -> str:
        text = self.free_text(fmt.excludes, fmt.max_chars)
        if stop:
            return self.rule(text, f"[suffix={self.stop_terminal(stop)}]")
        if at_end:
            return self.rule(text)
        raise _refuse(f"{where}: free text must end the output or be a tag's content")

    def _triggered(
        self, fmt: TriggeredTags, stop: tuple[str, ...] | None, at_end: bool, where: str
    ) -> str:
        text = self.free_text(fmt.excludes)
        tags = []
        for index, tag in enumerate(fmt.tags):
            trigger = _trigger_of(tag, fmt.triggers) or ""
            head = self.rule(f"{text} {_literal(trigger)}", "[lazy]")
            rest = self._tag(tag, f"{where}.tags[{index}]", tag.begin[len(trigger) :])
            tags.append(f"{head} {rest}")
        any_tag = self.rule(" | ".join(tags))
        direct = self.rule(" | ".join(self._tag(tag, where) for tag in fmt.tags))
        first = direct if fmt.at_least_one else any_tag
        ended = self.stop_terminal(stop) if stop else ""
        if fmt.stop_after_first:
            return f"{first} {ended}".strip()
        tail = self.free_text(fmt.triggers + fmt.excludes)
        if stop:
            tail_rule = self.rule(tail, f"[suffix={self.stop_terminal(stop)}]")
        elif at_end:
            tail_rule = self.rule(tail)
        else:
            raise _refuse(f"{where}: triggered_tags must end the output or be a tag's content")
        if fmt.at_least_one:
            return self.rule(f"{first} {any_tag}* {tail_rule}")
        return self.rule(f"{any_tag}* {tail_rule}")

    def _separated(self, fmt: TagsWithSeparator, where: str) -> str:
        one = self.rule(
            " | ".join(self._tag(tag, f"{where}.tags[{i}]") for i, tag in enumerate(fmt.tags))
        )
        separator = _literal(fmt.separator) if fmt.separator else ""
        if fmt.stop_after_first:
            return one if fmt.at_least_one else self.rule(f"{one}?")
        many = self.rule(f"{one} ({separator} {one})*" if separator else f"{one}+")
        return many if fmt.at_least_one else self.rule(f"{many}?")


def structural_tag_grammar(fmt: Format, json_layout: dict[str, Any]) -> str:
    """llguidance's grammar (its JSON text) for ``fmt``: the whole output must match it."""
    compiler = _Compiler(json_layout)
    top = compiler.compile(fmt, None, True, "format")
    lark = "\n".join(["%llguidance {}", f"start: {top}", *compiler.rules])
    grammars = [{"name": "structural_tag", "lark_grammar": lark}, *compiler.grammars]
    return json.dumps({"grammars": grammars})
