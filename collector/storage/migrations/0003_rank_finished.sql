-- PostgreSQL migration 3, mirroring SQLite migration 3 (collector/storage/store.py):
-- a rank that ended cleanly (RankSummary.finished): its job is finished.
ALTER TABLE ranks ADD COLUMN finished BIGINT NOT NULL DEFAULT 0;
