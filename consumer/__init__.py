"""dgr consumer: the batching worker service (one per GPU)."""
