"""Device-agnostic core of inferhal: contract, registry, config, paging, scheduling, models, engine.

Importing this package imports no device library and no backend (``tests/core/test_isolation.py``).
"""
