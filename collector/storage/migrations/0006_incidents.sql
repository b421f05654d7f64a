-- PostgreSQL migration 6, mirroring SQLite migration 5 (collector/storage/store.py):
-- incidents, correlated findings with their lifecycle
-- (forewarn.collector.decide.incidents); "findings" is a JSON list of tracked findings.
CREATE TABLE incidents (
    id TEXT PRIMARY KEY, scope TEXT NOT NULL, kind TEXT NOT NULL, node TEXT NOT NULL,
    gpu BIGINT, job TEXT NOT NULL, state TEXT NOT NULL, health TEXT NOT NULL,
    worst TEXT NOT NULL, checks TEXT NOT NULL, opened DOUBLE PRECISION NOT NULL,
    updated DOUBLE PRECISION NOT NULL, closed DOUBLE PRECISION, orders BIGINT NOT NULL,
    findings TEXT NOT NULL);
CREATE INDEX incidents_updated ON incidents (updated);
CREATE INDEX incidents_state ON incidents (state);
