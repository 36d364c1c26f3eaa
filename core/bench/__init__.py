"""Benchmarks: ``inferhal bench <kind>`` runs ``inferhal.core.bench.<kind>.run(cfg)``."""
