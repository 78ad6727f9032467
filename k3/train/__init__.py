"""Training: expert balancing (SPEC §4.1); the loop, optimiser and schedule (SPEC §5)."""
