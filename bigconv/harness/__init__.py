"""The measurement harness: per-worker memory and utilization recorder, the JSONL records format,
the registry of benchmark models, one measured run in fresh processes, and the workload helpers.

Library code that scripts import; the command-line entry points stay in ``experiments/`` and
``plots/`` (run from a checkout with ``python -m``).
"""
