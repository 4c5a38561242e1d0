"""Layer 5, the execution engine: one shard's step, the same for the driver's workers and SPMD ranks.

``executor`` runs the op rules' exchanges on the link it is handed; ``dry_run`` runs every shard on
meta tensors before any remote work; ``checkpointing`` replays a checkpointed block's exchanges;
``buckets`` sums replicated weights' gradients while backward runs; ``step`` is the shard-step
(forward on the shard, the per-shard loss part, backward, the gradient sum, the optimizer step).
"""
