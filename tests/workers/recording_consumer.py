"""A service-like process for fault tests: runs the consumer runtime and records every message it handles.

Each handled message appends "partition offset key" to a log file (fsync'd) before the handler returns,
so a test can tell exactly what was processed, and how often, across kills and restarts.
"""

from __future__ import annotations

import argparse
import os
import time

from eventstore.logs import configure_logging
from eventstore.producer import EventProducer
from eventstore.runtime import ConsumerRuntime, Record
from eventstore.settings import ConsumerSettings, KafkaSettings
from eventstore.topics import TopicLayout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--topic", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--work-s", type=float, default=0.0)
    args = parser.parse_args()
    configure_logging()
    kafka = KafkaSettings()
    layout = TopicLayout.from_settings(kafka)

    def handle(record: Record, _output: EventProducer) -> None:
        with open(args.log + ".started", "a") as started:
            started.write(f"{record.partition} {record.offset} {record.key}\n")
        time.sleep(args.work_s)
        with open(args.log, "a") as log:
            log.write(f"{record.partition} {record.offset} {record.key}\n")
            log.flush()
            os.fsync(log.fileno())

    runtime = ConsumerRuntime(bootstrap=kafka.resolved_bootstrap(), group_id=args.group, topics=[args.topic],
                              handler=handle, dlq_topic=layout.dlq, settings=ConsumerSettings())
    runtime.install_signal_handlers()
    runtime.run()


if __name__ == "__main__":
    main()
