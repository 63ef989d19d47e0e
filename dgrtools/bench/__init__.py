"""dgr benchmarks (`dgr bench ...`)."""
