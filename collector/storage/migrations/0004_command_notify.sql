-- Every replica's long polls learn at once of a command queued by another replica (the
-- leader): a NOTIFY per new command, on the channel PostgresStore.watch_commands listens to.
CREATE FUNCTION forewarn_command_queued() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('forewarn_commands', NEW.node);
    RETURN NULL;
END;
$$;

CREATE TRIGGER commands_notify AFTER INSERT ON commands
    FOR EACH ROW EXECUTE FUNCTION forewarn_command_queued();
