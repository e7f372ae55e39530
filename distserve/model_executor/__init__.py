"""Running the model on one rank: loading (real or dummy weights, sharded), the paged KV cache,
the attention function registered with transformers, the model runner, the sampler, the worker."""
