-- SQLite migration 3: a rank that ended cleanly (RankSummary.finished): its job is finished.
ALTER TABLE ranks ADD COLUMN finished BIGINT NOT NULL DEFAULT 0;
