"""Sampling parameters of a request and the per-request generator rules."""
