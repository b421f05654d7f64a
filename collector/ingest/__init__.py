"""What comes in: agent batches (validated, bounded, authorised) and alert webhooks."""
