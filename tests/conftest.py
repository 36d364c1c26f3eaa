"""Shared test setup. Tests never put the repository root on sys.path (see pyproject: --import-mode=importlib)."""
