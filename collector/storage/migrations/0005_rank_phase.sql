-- SQLite migration 4: a rank's phase (RankSummary.phase: eval, data, ...).
ALTER TABLE ranks ADD COLUMN phase TEXT NOT NULL DEFAULT '';
