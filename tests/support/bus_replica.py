"""A collector replica on the bus, as a process that tests can SIGKILL.

``python tests/support/bus_replica.py DB NATS_URL PASSWORD ACK_WAIT_S STREAM_REPLICAS`` runs the
collector's bus consumer (:class:`~forewarn.collector.ingest.bus.BusConsumer`) over the
real ingest path (:class:`~forewarn.collector.ingest.batch.IngestWriter`, bodies in the
``staged_samples`` rows) on the SQLite database ``DB``, which several replicas share: the
exactly-once record, ``batches`` keyed by ``(agent_id, seq)``, is then one for all of them,
as PostgreSQL's will be in the scale-out mode. It prints ``ready`` once consuming, and
stops on SIGTERM. HTTP, the policy and the Parquet flush are left out: they are not what
a replica's failover tests look at.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from forewarn.collector.config import CollectorConfig
from forewarn.collector.ingest.batch import IngestWriter
from forewarn.collector.ingest.bus import BusConsumer
from forewarn.collector.metrics import CollectorMetrics
from forewarn.collector.storage.commands import CommandQueue
from forewarn.collector.storage.store import Store


async def serve(db: Path, url: str, password: str, ack_wait_s: float, replicas: int
                ) -> None:
    config = CollectorConfig(data_dir=db.parent, tokens_file=db.parent / "none.toml",
                             bus_url=url, bus_password=password, bus_ack_wait_s=ack_wait_s,
                             bus_fetch_max=64, bus_stream_replicas=replicas)
    store = Store(db)
    metrics = CollectorMetrics()
    writer = IngestWriter(store, metrics, group_max=config.group_commit_max)
    commands = CommandQueue(store, metrics)
    writer.start()
    consumer = BusConsumer(config, writer, metrics, commands, on_ack=commands.ack)
    await consumer.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await consumer.stop()
    writer.stop()
    store.close()


if __name__ == "__main__":
    asyncio.run(serve(Path(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4]),
                      int(sys.argv[5])))
