-- PostgreSQL migration 5, mirroring SQLite migration 4 (collector/storage/store.py):
-- a rank's phase (RankSummary.phase: eval, data, ...).
ALTER TABLE ranks ADD COLUMN phase TEXT NOT NULL DEFAULT '';
