"""``inferhal kernels compile``'s report (core/cli/cmd_kernels.py) on made-up rows: the table names every kernel,
and a line after it names the kernels with spill stack (or says there are none). The compile itself is
tests/kernels/test_aot.py's."""

from inferhal.core.cli.cmd_kernels import _print


def row(name, spill, compiled=True):
    return {"kernel": name, "op": "linear", "compiled": compiled, "registers": 200, "spill_stack_bytes": spill,
            "shared_bytes": 1024, "tmem_columns": 0, "mma": "wgmma", "mma_ok": True, "error": "boom"}


def test_the_report_names_the_kernels_that_spill(capsys, tmp_path):
    _print([row("a_kernel", 0), row("b_kernel", 64), row("c_kernel", None, compiled=False)], "sm_90a", "cuda_sm100",
           str(tmp_path / "k.json"))
    out = capsys.readouterr().out
    assert "a_kernel" in out and "b_kernel" in out and "boom" in out
    assert "spill stack in 1 of 3 kernels: b_kernel (64 B)" in out


def test_the_report_says_when_nothing_spills(capsys, tmp_path):
    _print([row("a_kernel", 0)], "sm_100a", "cuda_sm100", str(tmp_path / "k.json"))
    assert "spill stack in none of the 1 kernels" in capsys.readouterr().out
