"""Parallelism inside an instance: ranks and stages, the instance's torch.distributed group, tensor
parallel sharding by a model's tp plan, pipeline stages."""
