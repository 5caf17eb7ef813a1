"""refserve's engine: request state machine, paged KV pool, scheduler, executors, CLI."""
