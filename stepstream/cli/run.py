"""``stepstream run SERVICE [NAME]`` (one service in the foreground) and ``stepstream up`` (a whole local
system): the processes of ``stepstream.local``."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = commands.add_parser("run", help="run one service in the foreground (SIGTERM drains it)")
    run.add_argument("service", choices=["scheduler", "agent", "projector", "supervisor"])
    run.add_argument("name", nargs="?", help="the agent's name, for `run agent` (one stepstream.toml declares)")
    run.set_defaults(func=_run)

    up = commands.add_parser("up", help="run a whole local system until SIGTERM/Ctrl-C")
    up.add_argument("--service-port", type=int, default=None,
                    help="port of the service the project runs (stepstream.toml [services.NAME] command; without "
                         "a project file, the demo's order service)")
    up.set_defaults(func=_up)


def _up(args: argparse.Namespace) -> int:
    from stepstream.local.up import run_up

    return run_up(service_port=args.service_port)


def _run(args: argparse.Namespace) -> int:
    from stepstream.local import services

    if args.service == "agent":
        if not args.name:
            from stepstream.project.files import find_project

            project = find_project()
            raise SystemExit(f"stepstream run agent: NAME is required, one of the agents declared in {project.where()}"
                             f": {', '.join(sorted(project.spec.agents))}")
        return services.run_agent(args.name)
    if args.name:
        raise SystemExit(f"stepstream run {args.service}: takes no NAME")
    runners: dict[str, Callable[[], int]] = {
        "scheduler": services.run_scheduler,
        "projector": services.run_projector,
        "supervisor": services.run_supervisor,
    }
    return runners[args.service]()
