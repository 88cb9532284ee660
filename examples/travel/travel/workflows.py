"""The ``trip`` workflow: book a flight, book a hotel, charge the card; a step refused for good (a declined
card) undoes what may have been applied, in reverse order: refund, cancel the hotel, cancel the flight."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from scheduler.workflow import Compensation, Step, Workflow, WorkflowRegistry


class TripInput(BaseModel):
    """What a trip needs; ``card`` ``"declined"`` is refused by the service's payments for good."""

    model_config = ConfigDict(extra="forbid")

    trip_id: str = Field(min_length=1)
    flight: str = Field(min_length=1)
    hotel: str = Field(min_length=1)
    nights: int = Field(ge=1)
    amount: float = Field(gt=0)
    card: str = Field(min_length=1)


def _undo(agent: str) -> Compensation:
    return Compensation(agent, timeout_s=5.0, attempt_budget=5, calls_per_attempt=2)


TRIP = Workflow(
    name="trip", version=1, input_model=TripInput, failure_threshold=3, escalation="compensate",
    steps=(
        Step("flight", agent="flights", timeout_s=5.0, attempt_budget=5, calls_per_attempt=2,
             compensation=_undo("flights-cancel")),
        Step("hotel", agent="hotels", timeout_s=5.0, attempt_budget=5, calls_per_attempt=2,
             compensation=_undo("hotels-cancel")),
        Step("charge", agent="payments", timeout_s=5.0, attempt_budget=5, calls_per_attempt=2,
             compensation=_undo("payments-refund")),
    ),
)

REGISTRY = WorkflowRegistry.of([TRIP])
