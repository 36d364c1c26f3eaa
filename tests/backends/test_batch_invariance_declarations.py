"""Batch invariance as capability data per op (``inferhal_op_batch_invariance``): every in-tree backend declares
each op it provides; ``deterministic=true`` / ``backend.batch_invariant=true`` is refused naming the ops that do
not declare it, with their reasons; ``inferhal backends`` and qualify read the same data."""

from __future__ import annotations

import pytest

from inferhal.core.config.schema import BackendConfig
from inferhal.core.ops.invariance import BatchInvariance
from inferhal.core.ops.vocabulary import OPS
from inferhal.core.registry import BackendRegistry, BackendSelectionError
from tests.core.test_registry import double_rms, make_plugin


def with_declarations(name: str, declared, ops=None):
    def op_batch_invariance():
        return declared

    op_batch_invariance.__name__ = "inferhal_op_batch_invariance"
    return make_plugin(name, ops=ops, extra_hooks={"inferhal_op_batch_invariance": op_batch_invariance})


@pytest.fixture(scope="module")
def reg():
    ops = {"norm.rms": double_rms, "linear": lambda x, w, b=None: x @ w.T}
    return BackendRegistry.discover(extra={
        "mixed": with_declarations("mixed", {"norm.rms": BatchInvariance(True, "one program per row"),
                                             "linear": BatchInvariance(False, "split-K from the token count")}, ops),
        "allinv": with_declarations("allinv", {op: BatchInvariance(True, "fixed tiles") for op in ops}, ops),
        "partly": with_declarations("partly", {"norm.rms": BatchInvariance(True, "one program per row")}, ops),
        "wrong": with_declarations("wrong", {"norm.rms": True}, ops),
        "nodecl": make_plugin("nodecl", ops={"norm.rms": double_rms}),
    })


def test_every_in_tree_backend_declares_every_op_it_provides(reg):
    for name in ("reference", "cuda_sm100", "ascend950", "cpu_amx", "cpu_avx512"):
        declared = reg.op_batch_invariance(name)
        assert declared is not None, name
        assert set(reg.declared_ops(name)) <= set(declared), (name, set(reg.declared_ops(name)) - set(declared))
        assert set(declared) <= set(OPS)


def test_the_refusal_names_each_op_that_cannot_honour_it_with_its_reason(reg):
    with pytest.raises(BackendSelectionError, match=r"deterministic=true: backend 'mixed' cannot honour it: its op "
                                                    r"linear \(split-K from the token count\) declares no batch"):
        reg.check_deterministic(BackendConfig(name="mixed"))
    with pytest.raises(BackendSelectionError, match=r"backend.batch_invariant=true: backend 'mixed' cannot honour it: "
                                                    r"its op linear"):
        reg.select(BackendConfig(name="mixed", batch_invariant=True))
    # an op provided but left out of the declarations is not invariant
    with pytest.raises(BackendSelectionError, match=r"its op linear \(the backend declares no batch invariance"):
        reg.check_deterministic(BackendConfig(name="partly"))
    # no per-op data and no profile claim: every op it runs is named
    with pytest.raises(BackendSelectionError, match=r"'nodecl' cannot honour it: its op norm.rms"):
        reg.check_deterministic(BackendConfig(name="nodecl"))


def test_a_malformed_declaration_is_a_selection_error(reg):
    with pytest.raises(BackendSelectionError, match="declares batch invariance wrongly: .*not a BatchInvariance"):
        reg.check_deterministic(BackendConfig(name="wrong"))
    with pytest.raises(ValueError, match="needs a reason"):
        BatchInvariance(True, "")


def test_when_every_op_declares_it_the_mode_is_on_and_fallbacks_are_the_reference_in_its_mode(reg):
    from inferhal.backends.reference.matmul import tiled_linear

    reg.check_deterministic(BackendConfig(name="allinv"))
    active = reg.select(BackendConfig(name="allinv", batch_invariant=True))
    assert active.profile.supports("batch_invariant")
    assert getattr(active.ops.entry("lm_head").fn, "keywords", {}).get("mm") is tiled_linear  # a fallback
    assert not reg.select(BackendConfig(name="allinv")).profile.supports("batch_invariant")


def test_the_matrix_inferhal_backends_prints(reg):
    matrix = reg.invariance_matrix()
    # linear switches to its decode kernel up to 128 rows and moe.experts to its decode tiles up to 32 pairs an
    # expert: invariant in the mode only
    sm100 = matrix["cuda_sm100"]
    assert sm100["linear"]["state"] == sm100["moe.experts"]["state"] == "in mode"
    assert {c["state"] for op, c in sm100.items() if op not in ("linear", "moe.experts")} == {"always"}
    assert {c["state"] for c in matrix["reference"].values()} == {"in mode"}
    assert matrix["ascend950"]["attn.paged"]["state"] == "no"
    assert matrix["cpu_amx"]["linear"]["state"] == "no" and matrix["cpu_amx"]["moe.route"]["state"] == "fallback"
    assert matrix["nodecl"]["norm.rms"]["state"] == "undeclared"
    assert matrix["wrong"]["norm.rms"]["state"] == "invalid"


def test_qualify_checks_batch_invariance_per_declared_op(reg):
    from inferhal.core.qualify.runner import op_invariant

    mixed = reg.select(BackendConfig(name="mixed"))
    assert op_invariant(mixed, "norm.rms") and not op_invariant(mixed, "linear")
    ref = reg.select(BackendConfig(name="reference"))
    assert not op_invariant(ref, "linear")  # invariant in its mode only
    assert op_invariant(reg.select(BackendConfig(name="reference", batch_invariant=True)), "linear")


def test_inferhal_backends_prints_the_table_and_the_reasons(capsys):
    from inferhal.core.cli.main import main

    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "batch invariance per op" in out
    assert "cpu_amx: norm.rms, linear" in out and "run the reference's default op" in out
