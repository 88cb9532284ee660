"""``stepstream``: one thin command in front of every service and tool.

Each verb's command line is defined in its own module here, next to the few lines that call into the package
that owns the work (``tasks``: submit, status, tasks; ``operator``: task ...; ``broker``: broker, topics;
``run``: run, up; ``projections``, ``serve``, ``dlq``, ``keys``, ``outbox``, ``demo``). This module only gathers them
and turns the errors every verb may meet into exit codes; before any of them, it reads the project file
(``stepstream.project``), so every verb runs the same workflows and agents.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from confluent_kafka import KafkaException

from eventstore.errors import KafkaUnreachable, RestartRequired, StepstreamError
from eventstore.kafka_config import kafka_reason
from eventstore.producer import is_fatal
from eventstore.stall import EXIT_STALLED
from schemas.sealed import SealingError
from stepstream.cli import broker, demo, dlq, keys, operator, outbox, projections, run, serve, tasks
from stepstream.project.files import configure

EXIT_UNAVAILABLE = 69  # sysexits' EX_UNAVAILABLE: the Kafka cluster did not answer
DESCRIPTION = ("``stepstream``: one thin command in front of every service and tool. Each sub-command parses its "
               "arguments and calls into the package that owns the work.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepstream", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    for verbs in (broker, run, tasks, operator, projections, serve, dlq, keys, outbox, demo):
        verbs.add_parsers(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:  # first: the project's workflows, agents and services are every command's settings (and --help's)
        configure()
    except StepstreamError as exc:
        print(f"stepstream: {exc}", file=sys.stderr)
        return 1
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # no command: the list of them, not argparse's one-liner
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except RestartRequired as exc:  # a service that a fresh process recovers: 75, which supervisors restart
        print(f"stepstream: {exc}", file=sys.stderr)
        return EXIT_STALLED
    except KafkaUnreachable as exc:
        print(f"stepstream: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (StepstreamError, SealingError) as exc:  # a missing or wrong encryption key too: one line, no key
        print(f"stepstream: {exc}", file=sys.stderr)
        return 1
    except KafkaException as exc:  # a broker lost mid-command: its reason, not a librdkafka traceback
        print(f"stepstream: Kafka: {kafka_reason(exc)}", file=sys.stderr)
        # A client broken for good (a fenced transactional producer, wherever it says so: a produce while the
        # consumer's partitions are revoked too) is mended by a fresh process: 75, which supervisors restart.
        return EXIT_STALLED if is_fatal(exc) else EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        return 130
