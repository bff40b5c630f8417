"""Multi-process training: FSDP2 sharding (fsdp), SLURM preemption and requeue (slurm), elastic
resume (elastic) and context parallelism's process group and all-gather (context_parallel).
Import the submodule you need: the package itself imports nothing. The model and data import
none of it: the context-parallel layout is longctx.context_shard."""
