"""``stepstream run SERVICE [NAME]`` (one service in the foreground) and ``stepstream up`` (a whole local
system): the processes of ``stepstream.local``."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = commands.add_parser("run", help="run one service in the foreground (SIGTERM drains it)")
    run.add_argument("service", choices=["scheduler", "agent", "agents", "projector", "supervisor"])
    run.add_argument("names", nargs="*", metavar="NAME",
                     help="`run agent NAME`: the agent (one stepstream.toml declares); `run agents [NAME ...]`: the "
                          "agents run together in one process (default: every agent the workflows name)")
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
        if len(args.names) != 1:
            from stepstream.project.files import find_project

            project = find_project()
            raise SystemExit(f"stepstream run agent: one NAME is required, one of the agents declared in "
                             f"{project.where()}: {', '.join(sorted(project.spec.agents))} (`stepstream run "
                             "agents NAME ...` runs several in one process)")
        return services.run_agent(args.names[0])
    if args.service == "agents":
        return services.run_agents(args.names)
    if args.names:
        raise SystemExit(f"stepstream run {args.service}: takes no NAME")
    runners: dict[str, Callable[[], int]] = {
        "scheduler": services.run_scheduler,
        "projector": services.run_projector,
        "supervisor": services.run_supervisor,
    }
    return runners[args.service]()
