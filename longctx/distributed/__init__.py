"""Multi-process training: FSDP2 sharding (fsdp), SLURM preemption and requeue (slurm), elastic
resume (elastic) and context parallelism (context_parallel). Import the submodule you need: the
package itself imports nothing, so the model can use context parallelism without Lightning."""
