"""The node agent: polls GPUs, hears the training ranks, acts locally within a second,
exports Prometheus metrics and forwards everything to the collector."""
