"""How a step moves KV into and out of an instance's cache: one connector interface in two halves
(``base``: the scheduler's, in the engine; the worker's, on each rank), and its implementations,
preemption by swap (``swap``) and the shared prefix tier (``tier``)."""
