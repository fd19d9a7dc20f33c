"""``splitserve`` command line: the serving roles, offline generation and a local chat.

    splitserve up                        # coordinator + prefill + decode + gateway on localhost
    splitserve coordinator|prefill|decode|gateway --help   # one role per process
    splitserve frontend --help           # coordinator + gateway in one process
    splitserve probe --address HOST:PORT # one gRPC health check (Kubernetes exec probes)
    splitserve top --coordinator HOST:PORT --metrics URL  # a live view of a cluster

    splitserve generate "The capital of France is" --max-tokens 32 --temperature 0
    splitserve generate --chat "Write a haiku about the sea" --stream
    splitserve chat                      # interactive; reads one user turn per line

This module is the command table, the console script's entry point (``main``): a role command
imports its module (``ROLE_COMMANDS``) only when it runs and hands it the rest of the
arguments; ``generate`` and ``chat`` are the engine's (``engine/cli.py``). Errors a user can
cause (bad flags, a missing model, an over-long prompt) print one clear line and exit with
status 2; nothing else is lost.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from splitserve.engine.cli import add_offline_commands, run_offline

ROLE_COMMANDS = {
    "coordinator": "splitserve.coordinator.main",
    "prefill": "splitserve.prefill.main",
    "decode": "splitserve.decode.main",
    "worker": "splitserve.launch.dual_worker",
    "gateway": "splitserve.gateway.main",
    "frontend": "splitserve.frontend.main",
    "up": "splitserve.launch.up",
    "probe": "splitserve.launch.probe",
    "top": "splitserve.launch.top",
    "profile": "splitserve.launch.profile",
    "plan": "splitserve.launch.plan",
}
"""Commands with their own flags (``splitserve <command> --help``): the serving roles, each a
process, ``up`` (all of them on localhost), ``probe`` (one health check) and ``top`` (a live
view of a cluster). Each maps to the module whose ``main(argv) -> int`` runs it."""
COMMAND_HELP = {
    "worker": "run a worker of several roles, e.g. --roles prefill,decode",
    "frontend": "run a coordinator and the OpenAI-compatible gateway in one process",
    "up": "run every role on localhost",
    "probe": "one gRPC health check, for exec probes",
    "top": "a live view of a cluster's workers and traffic, from a coordinator",
    "profile": "measure a worker on this machine (step times, KV link, start-up) into a profile",
    "plan": "the cheapest fleet (worker counts, placement) meeting an SLO, by simulation",
}


def build_parser() -> argparse.ArgumentParser:
    """The parser of the whole command; raises ``ValueError`` when a ``SPLITSERVE_*`` variable
    does not parse. The role commands are listed for ``--help`` only: ``main`` hands them
    their arguments before this parser sees them."""
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for role in ROLE_COMMANDS:
        what = COMMAND_HELP.get(role, f"run the {role} role")
        commands.add_parser(role, help=f"{what} (see `splitserve {role} --help`)")
    add_offline_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``splitserve`` command (``argv`` defaults to ``sys.argv[1:]``); returns the exit
    status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ROLE_COMMANDS:
        return importlib.import_module(ROLE_COMMANDS[argv[0]]).main(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        parser = build_parser()
    except ValueError as error:  # a SPLITSERVE_* variable that does not parse
        print(f"splitserve: error: bad SPLITSERVE_* environment value: {error}", file=sys.stderr)
        return 2
    return run_offline(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
