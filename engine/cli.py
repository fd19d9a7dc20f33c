"""``splitserve`` command line: the serving roles, offline generation and a local chat.

    splitserve up                        # coordinator + prefill + decode + gateway on localhost
    splitserve coordinator|prefill|decode|gateway --help   # one role per process
    splitserve probe --address HOST:PORT # one gRPC health check (Kubernetes exec probes)
    splitserve top --coordinator HOST:PORT --metrics URL  # a live view of a cluster

    splitserve generate "The capital of France is" --max-tokens 32 --temperature 0
    splitserve generate --chat "Write a haiku about the sea" --stream
    splitserve chat                      # interactive; reads one user turn per line

Errors a user can cause (bad flags, a missing model, an over-long prompt) print one clear line
and exit with status 2; nothing else is lost.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from splitserve.common.errors import InvalidRequestError, SplitserveError
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.cli_args import (
    add_engine_args,
    add_sampling_args,
    engine_config_from_args,
    sampling_params_from_args,
)

if TYPE_CHECKING:  # imported when used: the roles and ``probe`` run without loading torch
    from splitserve.engine.llm import LLM


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for role in ROLE_COMMANDS:
        what = COMMAND_HELP.get(role, f"run the {role} role")
        commands.add_parser(role, help=f"{what} (see `splitserve {role} --help`)")
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
    return parser


ROLE_COMMANDS = {
    "coordinator": "splitserve.coordinator.main",
    "prefill": "splitserve.prefill.main",
    "decode": "splitserve.decode.main",
    "worker": "splitserve.launch.dual_worker",
    "gateway": "splitserve.gateway.main",
    "up": "splitserve.launch.up",
    "probe": "splitserve.launch.probe",
    "top": "splitserve.launch.top",
}
"""Commands with their own flags (``splitserve <command> --help``): the serving roles, each a
process, ``up`` (all of them on localhost), ``probe`` (one health check) and ``top`` (a live
view of a cluster)."""
COMMAND_HELP = {
    "worker": "run a worker of several roles, e.g. --roles prefill,decode",
    "up": "run every role on localhost",
    "probe": "one gRPC health check, for exec probes",
    "top": "a live view of a cluster's workers and traffic, from a coordinator",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ROLE_COMMANDS:
        return importlib.import_module(ROLE_COMMANDS[argv[0]]).main(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        parser = build_parser()
    except ValueError as error:  # a SPLITSERVE_* variable that does not parse
        print(f"splitserve: error: bad SPLITSERVE_* environment value: {error}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
