"""The kit's conformance suite, collected here so the repository's own test run includes it.

The tests live in :mod:`inferhal.core.qualify.conformance` (installed with inferhal, so out-of-tree
backends run the very same suite with ``pytest --inferhal-backend=NAME``).
"""

from inferhal.core.qualify.conformance import (  # noqa: F401
    test_case,
    test_claimed_ops_have_cases,
    test_declared_ops_match_provided,
    test_profile_is_data,
    test_strict_refuses_fallbacks,
)
