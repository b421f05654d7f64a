-- PostgreSQL migration 7, mirroring SQLite migration 6 (collector/storage/store.py):
-- the live scorer's learned state (every GPU's own baseline, alarm
-- memory, shadow counts), one row replaced at every save
-- (forewarn.collector.decide.scorer_state); "body" is a numpy .npz archive, never a pickle.
CREATE TABLE scorer_state (
    name TEXT PRIMARY KEY, time DOUBLE PRECISION NOT NULL, gpus BIGINT NOT NULL,
    body BYTEA NOT NULL);
