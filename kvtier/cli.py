"""kvtier, a KV-cache tier for vLLM and SGLang: check an install, run the demo, compile
and tune the kernels, run a node's cache server and a prefill/decode proxy. `kvtier
COMMAND --help` says more about each.

kvtier info     versions, devices seen, kernel backends, config in effect
kvtier demo     a real vLLM engine: time to first token cold vs a kvtier hit
kvtier kernels  kernel ops, backends available, what `auto` picks, tuning files in effect
kvtier precompile  compile the Triton kernels an engine will use (no JIT stall on its first request)
kvtier tune     sweep the Triton kernels' launch parameters on the local GPU; write tuning files
kvtier serve    a node-level cache server that engines share (remote_url: kvtier://host:port)
kvtier status   a running kvtier serve's health, tiers and counters
kvtier proxy    an OpenAI-compatible prefill/decode router in front of vLLM instances

Each subcommand is a module of :mod:`kvtier.commands`; this one only assembles them
(the first paragraph above is ``kvtier --help``'s description).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from kvtier.commands import demo, info, kernels, precompile, proxy, serve, status, tune
from kvtier.logs import set_kvtier_log_level
from kvtier.machine import dist_version

COMMANDS = {
    "info": info,
    "demo": demo,
    "kernels": kernels,
    "precompile": precompile,
    "tune": tune,
    "serve": serve,
    "status": status,
    "proxy": proxy,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--version",
        action="version",
        version=f"kvtier {dist_version('kvtier')}",
        help="print kvtier's version (as `kvtier info` reports it) and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        command_parser = sub.add_parser(name, help=command.HELP, description=command.DESCRIPTION)
        command.add_arguments(command_parser)
        command_parser.set_defaults(func=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the subcommand ``argv`` names; its exit code (2 when argparse refuses the
    arguments, 0 after ``--help``; 130 on Ctrl-C, 141 when the reader of the output went
    away, as a shell reports a process killed by SIGINT or SIGPIPE)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    try:
        set_kvtier_log_level()
    except ValueError as exc:
        print(f"kvtier {args.command}: {exc}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"kvtier {args.command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:  # `kvtier kernels --json | head`
        # NOTE: stdout points at nothing from here on, so that the interpreter's own
        # flush at exit does not fail on the closed pipe again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
