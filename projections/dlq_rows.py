"""How a record of the DLQ topic changes ``dlq_entries``: a dead letter adds a row, a replay marker
(written by ``stepstream dlq replay``) marks its dead letter replayed. Shared by the live projector and
by rebuilds, like ``rows.project`` for events."""

from __future__ import annotations

from eventstore.dlq import REPLAY_TIME, REPLAY_TO, DeadLetter
from projections.rows import Executor
from schemas.codec import default_codec


def project_dead_letter(db: Executor, letter: DeadLetter) -> None:
    target = letter.replay_of
    if target is not None:
        db.execute("update dlq_entries set replayed_at = ?, replayed_to = ? where partition = ? and dlq_offset = ?",
                   (letter.time_ms(REPLAY_TIME), letter.info.get(REPLAY_TO), *target))
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

