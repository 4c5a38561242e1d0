"""Experiments on top of bigconv: the demo, benchmarks and (later) sweeps. Results go to results/."""
