"""The commit watermark of a partition whose messages finish out of order (no broker needed)."""

from __future__ import annotations

import random

import pytest

from eventstore.watermark import Watermark, decode_finished, encode_finished


def test_nothing_taken_means_nothing_to_commit() -> None:
    assert Watermark().committable() is None


def test_a_later_message_finishing_first_does_not_move_the_watermark_past_an_earlier_unfinished_one() -> None:
    mark = Watermark()
    for offset in (10, 11, 12):
        mark.take(offset)
    mark.finish(12)
    mark.finish(11)
    assert mark.committable() == 10
    mark.finish(10)
    assert mark.committable() == 13


def test_the_watermark_stops_at_the_first_unfinished_offset_across_gaps() -> None:
    mark = Watermark()
    for offset in (3, 5, 9, 10):  # gaps: transaction markers, compacted records
        mark.take(offset)
    mark.finish(3)
    mark.finish(9)
    assert mark.committable() == 5
    mark.finish(5)
    assert mark.committable() == 10
    assert mark.pending == 1


def test_offsets_must_be_taken_in_increasing_order() -> None:
    mark = Watermark()
    mark.take(7)
    with pytest.raises(ValueError, match="must increase"):
        mark.take(7)


def test_in_any_finishing_order_the_watermark_is_the_first_unfinished_offset() -> None:
    rng = random.Random(12)
    for _ in range(200):
        offsets = sorted(rng.sample(range(1000), rng.randint(1, 40)))
        mark = Watermark()
        for offset in offsets:
            mark.take(offset)
        finished: set[int] = set()
        for offset in rng.sample(offsets, len(offsets)):
            mark.finish(offset)
            finished.add(offset)
            unfinished = [o for o in offsets if o not in finished]
            assert mark.committable() == (unfinished[0] if unfinished else offsets[-1] + 1)
            assert mark.pending == len(unfinished)


def test_the_finished_offsets_above_the_watermark_survive_the_commit_metadata() -> None:
    mark = Watermark()
    for offset in range(100, 140):
        mark.take(offset)
    for offset in (101, 105, 139, 120):
        mark.finish(offset)
    committed = mark.committable()
    assert committed == 100 and mark.finished_above() == [101, 105, 120, 139]
    metadata = encode_finished(committed, mark.finished_above())
    assert decode_finished(committed, metadata) == {101, 105, 120, 139}


def test_metadata_not_written_by_the_runtime_or_too_long_to_commit_names_nothing() -> None:
    assert decode_finished(5, None) == set()
    assert decode_finished(5, "someone else's note") == set()
    assert decode_finished(5, "stepstream.done1:zz,!") == set()
    assert encode_finished(0, []) == ""
    assert encode_finished(0, list(range(1, 100_000, 7))) == "", "over the broker's metadata limit: left out"
