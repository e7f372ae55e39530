"""One instance's engine: validation, the role it plays (prefill, decode, colocated), stepping the
scheduler and the executor, detokenization and output deltas."""
