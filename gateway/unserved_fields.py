"""Request fields the gateway does not serve: refused with a 400 naming them, or ignored with a
warning and a counter; never dropped without a word.

Contract (``UnservedFields.check``, called on every generation and tokenize request after
validation):
- a field vLLM's OpenAI server knows (or an OpenAI field with an effect on the output) that
  splitserve does not implement is refused with a 400 naming it, unless its value is one that
  asks for nothing (``None``, the default, an empty list or object: ``REFUSED``);
- any other field the request models do not declare (``model_extra``) is ignored, as vLLM
  does: the gateway logs a warning the first time it sees the name (at most
  ``MAX_WARNED_NAMES`` names, so a client sending random names cannot flood the log) and
  ``check`` returns the names for the ignored-fields counter (whose label is the
  name for fields listed in ``KNOWN_IGNORED``, else ``other``: the label set stays bounded).
- in chat messages (of any body with ``messages``), ``function_call`` is refused when
  non-empty; other undeclared message fields (``name``) are ignored the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from splitserve.gateway.errors import invalid

logger = logging.getLogger(__name__)

MAX_WARNED_NAMES = 256
OTHER = "other"
"""The counter's label for an ignored field not in ``KNOWN_IGNORED``."""


def _asks_nothing(value: Any) -> bool:
    return value is None or value == [] or value == {}


def _is(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: _asks_nothing(value) or value in allowed


@dataclass(frozen=True)
class Refusal:
    """Why a field is refused, and which values ask for nothing (``asks_nothing``)."""

    reason: str
    asks_nothing: Callable[[Any], bool] = _asks_nothing


_STRUCTURED = Refusal("this form of structured outputs is not supported")
_TOOLS = Refusal("OpenAI's deprecated function calling is not supported: send tools")
REFUSED: dict[str, Refusal] = {
    # structured outputs beyond what gateway/sampling.py:grammar_of serves
    "guided_whitespace_pattern": _STRUCTURED,
    "structural_tag": Refusal(
        "send a structural tag as response_format {'type': 'structural_tag', ...} or "
        "structured_outputs.structural_tag"
    ),
    # tools (OpenAI's deprecated function calling)
    "functions": _TOOLS,
    "function_call": Refusal(_TOOLS.reason, _is("none")),
    # sampling and output options of vLLM
    "logits_processors": Refusal("logits_processors are not supported"),
    "spaces_between_special_tokens": Refusal(
        "only spaces_between_special_tokens: true is supported", _is(True)
    ),
    "prompt_embeds": Refusal("prompt_embeds are not supported"),
    "kv_transfer_params": Refusal("kv_transfer_params is not supported"),
    "vllm_xargs": Refusal("vllm_xargs is not supported"),
    # chat rendering
    "mm_processor_kwargs": Refusal("multimodal inputs are not supported"),
    "audio": Refusal("audio output is not supported"),
    "modalities": Refusal("only the text modality is supported", lambda v: v in (None, ["text"])),
}
"""Fields with an effect splitserve does not implement, by name."""

KNOWN_IGNORED = frozenset({
    "metadata", "store", "service_tier",
    "guided_decoding_backend",
    "prediction", "web_search_options", "verbosity", "safety_identifier", "prompt_cache_key",
    "name",
})  # fmt: skip
"""Fields known to change nothing here, counted by name: ``guided_decoding_backend``
(structured outputs always use llguidance here), OpenAI's storage, billing and caching hints,
a message's ``name``."""

_MESSAGE_REFUSED = {"function_call": _TOOLS}


class UnservedFields:
    """The check, with the names already warned about (one gateway's, on its event loop)."""

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def check(self, body: BaseModel) -> list[str]:
        """Raise ``ApiError`` 400 for a refused field (module docstring); return the
        counter labels of the ignored ones, in the body's order."""
        ignored = self._extras(body.model_extra or {}, REFUSED, "")
        # a body's own messages field (chat's); a completion's stray "messages" is an extra
        messages = (
            getattr(body, "messages", None) if "messages" in type(body).model_fields else None
        )
        if messages:
            for index, message in enumerate(messages):
                where = f"messages.{index}."
                ignored += self._extras(message.model_extra or {}, _MESSAGE_REFUSED, where)
        return ignored

    def _extras(self, extras: dict[str, Any], refused: dict[str, Refusal], where: str) -> list[str]:
        ignored = []
        for name, value in extras.items():
            refusal = refused.get(name)
            if refusal is not None:
                if not refusal.asks_nothing(value):
                    raise invalid(f"{refusal.reason} ({where}{name})", f"{where}{name}")
                continue
            label = name if name in KNOWN_IGNORED else OTHER
            ignored.append(label)
            if len(self._warned) < MAX_WARNED_NAMES and name not in self._warned:
                self._warned.add(name)
                logger.warning("ignoring the request field %r: splitserve does not use it", name)
        return ignored
