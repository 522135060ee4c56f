"""What is derived from the log: the folded state and its one fold (``evolve``), invariants,
the persisted projection's row model, replay and time travel, and the audit."""
