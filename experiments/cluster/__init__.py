"""Cluster launch scripts (LSF/jsrun, SLURM/srun, torchrun) and the entry point every rank runs."""
