-- The lead epoch (collector/storage/fence.py): a replica that takes the policy lock
-- increments it; every leader-only write reads it FOR SHARE and is refused unless it is
-- the epoch that replica took. PostgreSQL only (embedded SQLite has one replica).
CREATE TABLE leadership (name TEXT PRIMARY KEY, epoch BIGINT NOT NULL);
INSERT INTO leadership (name, epoch) VALUES ('policy', 0);
