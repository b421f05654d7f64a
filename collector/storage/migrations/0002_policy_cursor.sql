-- How far the leader's policy has read the findings table (collector/storage/leader.py):
-- a new leader resumes here.
CREATE TABLE policy_cursor (
    name TEXT PRIMARY KEY, last_id BIGINT NOT NULL, updated DOUBLE PRECISION NOT NULL);
