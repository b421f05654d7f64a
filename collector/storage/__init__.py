"""Where it is kept: SQLite state, the staging log, Parquet telemetry, the data dir,
retention and the per-node command queues. The seam a scale-out backend plugs into."""
