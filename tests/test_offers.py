"""What submitters conclude from the versions the running schedulers publish (``scheduler.offers``), without Kafka."""

from __future__ import annotations

from datetime import UTC, datetime

from scheduler.offers import Offers, offer_of
from scheduler.workflow import WorkflowRegistry
from tests.workflows import ORDERS_CARD, ORDERS_V1, ORDERS_V2, ORDERS_V3

AT = datetime(2026, 1, 1, tzinfo=UTC)
OLD = offer_of(WorkflowRegistry.of([ORDERS_V1, ORDERS_V2]), "host-1", AT)
NEW = offer_of(WorkflowRegistry.of([ORDERS_V1, ORDERS_V2, ORDERS_V3]), "host-2", AT)


def test_a_version_no_running_scheduler_runs_is_refused_naming_the_ones_they_run() -> None:
    offers = Offers((OLD,))
    assert offers.refusal("orders", 3) == ("no running scheduler runs 'orders' v3 (they run v1, v2); it is accepted "
                                           "once a scheduler running it has started")
    assert offers.refusal("loans", None) == "no running scheduler runs a workflow named 'loans' (they run orders)"
    assert offers.refusal("orders", 2) is None and offers.refusal("orders", None) is None


def test_mid_rollout_a_version_one_scheduler_runs_is_offered_and_no_version_may_mean_either_latest() -> None:
    offers = Offers((OLD, NEW))
    assert offers.refusal("orders", 3) is None
    assert offers.versions("orders") == [1, 2, 3]
    assert offers.latest("orders") == [2, 3], "each scheduler pins its own latest"
    assert Offers((NEW,)).latest("orders") == [3]


def test_without_any_scheduler_publishing_nothing_is_refused_before_the_scheduler_answers() -> None:
    assert not Offers(()).known and Offers(()).refusal("orders", 9) is None


def test_an_offer_says_what_each_version_takes_and_which_fields_are_sealed() -> None:
    offer = offer_of(WorkflowRegistry.of([ORDERS_CARD]), "host-1", AT)
    assert [(w.name, w.version, w.sensitive) for w in offer.workflows] == [("orders-card", 1, ["card_token"])]
    assert "amount (number, required)" in offer.workflows[0].input
    assert offer.model_validate_json(offer.model_dump_json()) == offer
