-- PostgreSQL migration 8, mirroring SQLite migration 7 (collector/storage/store.py):
-- the replica whose data_dir holds each telemetry file. Replicas share
-- this table but each writes its Parquet files into its own data_dir, so each scrubs,
-- compacts, prunes and reads its own rows only (forewarn.collector.storage.telemetry).
-- Rows recorded before have replica '': recovery gives each to the replica holding its file.
ALTER TABLE telemetry_files ADD COLUMN replica TEXT NOT NULL DEFAULT '';
CREATE INDEX telemetry_files_replica ON telemetry_files (replica, day);
