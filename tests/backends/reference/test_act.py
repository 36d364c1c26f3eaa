"""act.gated: the gated MLP activation (SiLU for Llama-style MLPs, tanh-GELU for Gemma)."""

import math

import pytest
import torch

from inferhal.backends.reference.ops import OPS
from inferhal.core.ops.params import ActParams


def _gelu_tanh(x: float) -> float:
    return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_act_gated_matches_the_scalar_formula(kind):
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(5, 7, generator=g, dtype=torch.float64) * 3, torch.randn(5, 7, generator=g, dtype=torch.float64)
    y = OPS["act.gated"](gate, up, ActParams(kind))
    f = _gelu_tanh if kind == "gelu_tanh" else (lambda v: v / (1.0 + math.exp(-v)))
    want = torch.tensor([[f(a) * b for a, b in zip(ra, rb)] for ra, rb in zip(gate.tolist(), up.tolist())],
                        dtype=torch.float64)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    assert y.dtype == gate.dtype


def test_act_gated_keeps_the_input_dtype_and_rejects_unknown_kinds():
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    assert OPS["act.gated"](x, x, ActParams("gelu_tanh")).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="ActParams.kind"):
        ActParams("relu")
