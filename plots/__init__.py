"""Figures drawn from saved results only (JSON lines under results/), never by re-running."""
