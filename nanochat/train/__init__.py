"""Training: the run's configuration (config) and plan (planning, memory), the optimizers (optim), FSDP (sharding),
the weight average, the attention backend, the run's lifecycle, multi-node launches, preflight checks and the depth
probe."""
