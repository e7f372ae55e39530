"""How KV crosses between instances: which rank sends what to which (plan), the pair
communicators that move it (channel), and the decode side's puller (migrator)."""
