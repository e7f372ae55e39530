"""Who runs next and which KV blocks it holds: the block manager, the waiting queue, the running
batch and the schedulers built from them. Imports neither torch nor Ray."""
