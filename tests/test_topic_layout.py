"""The consumer group ids, defined once beside the topics (``TopicLayout``): their spelling is part of the
deployment's contract (docs/acls.md grants them, the lag report finds a deployment's groups by the prefix,
and a renamed group restarts its consumers from their reset position), so it is pinned here."""

from __future__ import annotations

import re

from eventstore.topics import TopicLayout, reader_group


def test_each_service_group_carries_the_prefix_and_the_documented_name() -> None:
    layout = TopicLayout(prefix="p.", partitions=3)
    assert layout.scheduler_group == "p.scheduler"
    assert layout.projector_group == "p.projector"
    assert layout.supervisor_group == "p.supervisor"
    assert layout.agent_group("payments") == "p.agent.payments"


def test_a_submitter_reads_its_reply_topic_with_a_fresh_group_under_its_own_dotted_prefix() -> None:
    layout = TopicLayout(prefix="p.", partitions=3)
    first, second = layout.submitter_group("alice"), layout.submitter_group("alice")
    assert first != second
    assert all(re.fullmatch(r"p\.submitter\.alice\.[0-9a-f]{8}", group) for group in (first, second))
    assert first.startswith(layout.submitter_groups("alice"))
    assert not first.startswith(layout.submitter_groups("alic"))


def test_readers_that_assign_partitions_name_a_throwaway_group_without_the_prefix() -> None:
    assert re.fullmatch(r"stepstream-range-[0-9a-f]{32}", reader_group("range"))
    assert reader_group("dlq-follower") != reader_group("dlq-follower")
