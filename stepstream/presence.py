"""Which steps of a task wait on an agent nobody runs, said where an operator looks (``stepstream status``,
the API's task and its agents, the dashboard, and ``stepstream_agent_group_members`` for alerts).

A step's attempt is handed to its agent's topic (the forward agent, or the compensation's while undoing);
if that agent's consumer group has no member, no process will take it, and the step would only read
``queued`` until its start-by passes. The groups' members (``projections.agent_groups``) turn that into
"no agent running for `hotels`" at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eventstore.topics import TopicLayout
from projections.agent_groups import AgentGroups
from scheduler.workflow import WorkflowNotFoundError, WorkflowRegistry
from schemas.states import StepStatus

FORWARD = frozenset({StepStatus.QUEUED, StepStatus.PROCESSING})
UNDOING = frozenset({StepStatus.COMPENSATION_QUEUED, StepStatus.COMPENSATING})


def no_agent(agent: str) -> str:
    return f"no agent running for `{agent}`"


def step_agent(registry: WorkflowRegistry, workflow: str, version: int, step: str, status: str) -> str | None:
    """The agent an attempt of ``step`` in ``status`` is handed to; None when no attempt is in progress."""
    if status not in FORWARD | UNDOING:
        return None
    try:
        found = next((s for s in registry.get(workflow, version).steps if s.name == step), None)
    except WorkflowNotFoundError:
        return None
    if found is None:
        return None
    if status in UNDOING:
        return None if found.compensation is None else found.compensation.agent
    return found.agent


@dataclass
class Presence:
    """The registry's agents and their groups' members, asked of the broker (cached briefly)."""

    registry: WorkflowRegistry
    groups: AgentGroups

    @classmethod
    def of(cls, registry: WorkflowRegistry, bootstrap: str, layout: TopicLayout, *,
           timeout_s: float = 5.0) -> Presence:
        groups = {agent: layout.agent_group(agent) for agent in registry.agents}
        return cls(registry, AgentGroups(bootstrap, groups, timeout_s=timeout_s))

    def unattended(self, task: Mapping[str, Any]) -> list[dict[str, str]]:
        """The task's steps in progress whose agent has no process running: step, agent and what to say."""
        waiting = {step["step"]: agent for step in task.get("steps") or []
                   if (agent := step_agent(self.registry, task["workflow"], task["workflow_version"], step["step"],
                                           step["status"])) is not None}
        if not waiting:
            return []
        members = self.groups.members()
        return [{"step": step, "agent": agent, "reason": no_agent(agent)}
                for step, agent in waiting.items() if members.get(agent, 1) == 0]
