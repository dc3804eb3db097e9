"""The ``bench`` command line: ``add_bench_parser`` hangs ``bench <subcommand>`` under a host CLI
(the project's console script), ``main`` runs the subcommands standalone
(``python -m benchmarks.cli serve ...``).

To add a subcommand, write a module with ``add_cli_args(parser)`` and ``run_cli(args) -> int``
and append a ``Subcommand`` to ``SUBCOMMANDS``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Subcommand:
    name: str
    module: str  # must define add_cli_args(parser) and run_cli(args) -> int
    help: str


SUBCOMMANDS: list[Subcommand] = [
    Subcommand("serve", "benchmarks.serve", "load-test an OpenAI-compatible server (like vllm bench serve)"),
    Subcommand("compare", "benchmarks.compare", "the same load against shardserve and its peers"),
    Subcommand("engine", "benchmarks.engine", "offline throughput of the engine alone (no HTTP)"),
    Subcommand("linear", "benchmarks.linear", "the native linear kernel vs torch's on a model's layer shapes"),
    Subcommand("step", "benchmarks.step", "the model's decode step alone vs the memory-bandwidth bound"),
    Subcommand("bandwidth", "benchmarks.bandwidth", "the memory-bound kernels vs the box's read bandwidth"),
    Subcommand("soak", "benchmarks.soak", "many requests while the server processes' memory is sampled"),
    Subcommand("chaos", "benchmarks.chaos", "a request mix while the engine cores are killed or frozen in turn"),
    Subcommand("hop", "benchmarks.hop", "per-step cost of shard actors vs in-process"),
    Subcommand("host", "benchmarks.host", "the engine core's host work per step"),
    Subcommand("caps", "benchmarks.caps", "other streams' TPOT beside one request at the list caps"),
    Subcommand("prediction", "benchmarks.prediction", "TPOT with a mostly right prediction vs without"),
    Subcommand("burst", "benchmarks.burst", "N requests at once: status counts, latency, /health"),
    Subcommand("plot", "benchmarks.plot", "plot latency CDFs and throughput vs concurrency from result files"),
]


def _add_subcommands(parser: argparse.ArgumentParser) -> None:
    subparsers = parser.add_subparsers(dest="bench_command", metavar="SUBCOMMAND", required=True)
    for sub in SUBCOMMANDS:
        module: Any = importlib.import_module(sub.module)
        sub_parser = subparsers.add_parser(sub.name, help=sub.help, description=sub.help)
        module.add_cli_args(sub_parser)
        # ``func`` is how the host CLI dispatches: ``sys.exit(args.func(args))``.
        sub_parser.set_defaults(func=module.run_cli)


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` (with its subcommands) on a host CLI's ``add_subparsers()`` object.
    Parsed args carry ``func(args) -> int``, the exit code."""
    parser = subparsers.add_parser(
        "bench", help="benchmark a server", description="Benchmarks for OpenAI-compatible servers."
    )
    _add_subcommands(parser)
    return parser


def build_parser(prog: str = "python -m benchmarks.cli") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Benchmarks for OpenAI-compatible servers.")
    _add_subcommands(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
