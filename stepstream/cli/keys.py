"""``stepstream keys report``: how many data keys each master key wraps (``eventstore.keys.key_report``).

After a rotation (a new master key first in ``STEPSTREAM_ENCRYPTION_KEYS``) each scheduler rewraps its
partitions' data keys under the new one; ``--retiring KID`` answers whether the old key may go: exit 0 when
it wraps no data key any more, 3 while it still wraps some (deleting it then would erase those tasks).
"""

from __future__ import annotations

import argparse

import orjson

from eventstore.settings import KafkaSettings

STILL_WRAPS = 3


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = commands.add_parser("keys", help="the data keys on the keys topic, per master key")
    keys.add_argument("action", choices=["report"])
    keys.add_argument("--retiring", metavar="KID", default=None,
                      help="exit 3 while master key KID still wraps a data key, 0 once it wraps none")
    keys.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    keys.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    from eventstore.keys import key_report
    from eventstore.topics import TopicLayout

    settings = KafkaSettings()
    report = key_report(settings.reachable_bootstrap(), TopicLayout.from_settings(settings).keys)
    if args.json:
        print(orjson.dumps({"data_keys": report.data_keys, "proposed": report.proposed, "erased": report.erased},
                           option=orjson.OPT_SORT_KEYS).decode())
    else:
        print(f"{'master key':<16}{'data keys':>10}{'proposed':>10}")
        for kid in sorted({*report.data_keys, *report.proposed}):
            print(f"{kid:<16}{report.data_keys.get(kid, 0):>10}{report.proposed.get(kid, 0):>10}")
        print(f"erased tasks whose tombstone is still on the topic: {report.erased}")
    if args.retiring is None:
        return 0
    left = report.wraps(args.retiring)
    if not args.json:
        print(f"{args.retiring}: " + (f"still wraps {left} data keys: keep it" if left else
                                      "wraps no data key: it may be deleted"))
    return STILL_WRAPS if left else 0
