"""What the engine-core process runs: the scheduler, the KV cache manager and block pool, the
requests, and the engine core that steps them (the front end and its clients are in engine/)."""
