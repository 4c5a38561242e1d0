"""Domain Separation Networks across workers (issue 6); filled in by its own work."""
