"""How KV crosses between instances: which rank sends what to which (plan), the pair
communicators that move it (channel), their checks (checksum), and the decode side's puller."""
