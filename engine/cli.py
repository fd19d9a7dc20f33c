"""The offline subcommands of ``splitserve``: generation and a local chat on an in-process ``LLM``.

    splitserve generate "The capital of France is" --max-tokens 32 --temperature 0
    splitserve generate --chat "Write a haiku about the sea" --stream
    splitserve chat                      # interactive; reads one user turn per line

``launch/cli.py`` (the command table) adds these subcommands with ``add_offline_commands`` and
runs them with ``run_offline``. Importing this module loads no torch: ``LLM`` is imported when
a subcommand runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from splitserve.common.errors import InvalidRequestError, SplitserveError
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.cli_args import (
    add_engine_args,
    add_sampling_args,
    engine_config_from_args,
    sampling_params_from_args,
)

if TYPE_CHECKING:  # imported when used: the command table loads this module without torch
    from splitserve.engine.llm import LLM


def add_offline_commands(commands: argparse._SubParsersAction) -> None:
    """Add ``generate`` and ``chat``, each with the engine and sampling flags, to ``commands``
    (a parser's subparsers, whose ``dest`` is ``command``). Raises ``ValueError`` when a
    ``SPLITSERVE_*`` variable that sets a flag's default does not parse."""
    generate = commands.add_parser("generate", help="complete prompts and print the results")
    generate.add_argument("prompts", nargs="+", help="prompt texts (one request each)")
    generate.add_argument("--chat", action="store_true", help="apply the chat template")
    generate.add_argument("--stream", action="store_true", help="print text as it is generated")
    generate.add_argument("--json", action="store_true", help="print one JSON object per result")
    chat = commands.add_parser("chat", help="interactive chat with the model")
    chat.add_argument("--system", default=None, help="system prompt")
    for sub in (generate, chat):
        add_engine_args(sub)
        add_sampling_args(sub)


def run_offline(args: argparse.Namespace) -> int:
    """Run ``args.command`` (``generate`` or ``chat``) on an ``LLM`` built from ``args``.
    Returns the exit status: 0 done, 2 for an error a user can cause (bad flags, a missing
    model, an over-long prompt; printed as one line), 130 on Ctrl-C."""
    from splitserve.engine.llm import LLM  # torch: only offline generation and chat need it

    try:
        params = sampling_params_from_args(args)
        llm = LLM(config=engine_config_from_args(args))
        if args.command == "generate":
            return _generate(llm, args, params)
        return _chat(llm, args, params)
    except SplitserveError as error:
        print(f"splitserve: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _generate(llm: LLM, args: argparse.Namespace, params: SamplingParams) -> int:
    prompts = list(args.prompts)
    if args.chat:
        prompts = llm.render_chats([[{"role": "user", "content": p}] for p in prompts])
    if args.stream and len(prompts) > 1:
        raise InvalidRequestError("--stream takes one prompt", "stream")
    if args.stream:
        for chunk in llm.stream(prompts, params):
            print(chunk.text, end="", flush=True)
        print()
        return 0
    for result in llm.generate(prompts, params):
        if args.json:
            record = {
                "text": result.text,
                "token_ids": result.token_ids,
                "finish_reason": result.finish_reason.value,
                "num_prompt_tokens": len(result.prompt_token_ids),
            }
            print(json.dumps(record))
        else:
            print(result.text)
    return 0


def _chat(llm: LLM, args: argparse.Namespace, params: SamplingParams) -> int:
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    if interactive:
        print("splitserve chat: type a message, Ctrl-D to quit.", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", flush=True, file=sys.stderr)
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        try:
            reply = _stream_reply(llm, messages, params)
        except InvalidRequestError as error:  # e.g. the conversation outgrew the context
            messages.pop()
            print(f"splitserve: {error.message} (message dropped)", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": reply})


def _stream_reply(llm: LLM, messages: list[dict[str, str]], params: SamplingParams) -> str:
    [prompt] = llm.render_chats([messages])
    reply = []
    for chunk in llm.stream([prompt], params):
        reply.append(chunk.text)
        print(chunk.text, end="", flush=True)
    print(flush=True)
    return "".join(reply)
