"""The worker: the model runner (inputs, the KV-cache tensors, block copies), the sampler and
CUDA graphs. Tensors only; it learns everything it needs from the scheduler's output."""
