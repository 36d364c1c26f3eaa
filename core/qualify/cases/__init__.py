"""Every op's conformance cases, in one place: the pytest conformance suite and ``inferhal qualify`` both
read them from here. ``op_cases(op_id, level)`` lists an op's cases; an op without cases is reported as
"no case" by qualify and skipped (with that reason) by the conformance suite.

Adding an op to the vocabulary? Add its cases in a module here (``@cases_for("op.id")``), with a
tolerance whose ``why`` a reader can check.
"""

from inferhal.core.qualify.cases import (  # noqa: F401  (registers the cases)
    attention, dense, ep, moe_mhc, sampling, sparse_attention)
from inferhal.core.qualify.cases.base import LEVELS, OpCase, op_cases, registered_ops, to_device

__all__ = ["LEVELS", "OpCase", "op_cases", "registered_ops", "to_device"]
