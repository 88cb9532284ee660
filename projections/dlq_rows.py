"""How a record of the DLQ topic changes ``dlq_entries``: a dead letter adds a row, a replay marker
(written by ``stepstream dlq replay``) marks its dead letter replayed, a discard marker (``dlq discard``)
discarded. Shared by the live projector and by rebuilds, like ``rows.project`` for events."""

from __future__ import annotations

from eventstore.dlq import DISCARD_SHREDDED, DISCARD_TIME, REPLAY_TIME, REPLAY_TO, DeadLetter
from projections.rows import Executor
from schemas.codec import default_codec


def project_dead_letter(db: Executor, letter: DeadLetter) -> None:
    if (target := letter.replay_of) is not None:
        db.execute("update dlq_entries set replayed_at = ?, replayed_to = ? where partition = ? and dlq_offset = ?",
                   (letter.time_ms(REPLAY_TIME), letter.info.get(REPLAY_TO), *target))
        return
    if (target := letter.discard_of) is not None:  # the first discard counts: a second one finds none to shred
        db.execute("update dlq_entries set discarded_at = ?, discard_shredded = ? "
                   "where partition = ? and dlq_offset = ? and discarded_at is null",
                   (letter.time_ms(DISCARD_TIME), letter.info.get(DISCARD_SHREDDED) or None, *target))
        return
    origin = letter.origin
    info = letter.info
    db.execute(
        "insert into dlq_entries(partition, dlq_offset, message_key, origin_topic, origin_partition, origin_offset, "
        "consumer_group, reason, error_class, error_kind, message_type, size, dead_at) "
        "values (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (letter.partition, letter.offset, letter.task_id, *(origin or (info.get("origin.topic"), None, None)),
         info.get("consumer.group"), info.get("reason"), info.get("error.class"), info.get("error.kind"),
         letter.message_type(default_codec()), len(letter.value or b""), letter.dead_at_ms),
    )

