"""N-gram speculative decoding: the draft pool, the proposer, the step-cost policy and draft verification."""
