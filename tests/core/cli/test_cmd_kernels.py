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


def test_the_report_says_what_each_stack_costs_where_the_backend_counted_it(capsys, tmp_path):
    rows = [row("frame_only", 8), row("spilling", 56), row("uncounted", 16)]
    rows[0].update(local_loads=0, local_stores=0)
    rows[1].update(local_loads=14, local_stores=12)
    _print(rows, "sm_90a", "cuda_sm100", str(tmp_path / "k.json"))
    out = " ".join(capsys.readouterr().out.split())
    assert ("spill stack in 3 of 3 kernels: frame_only (8 B, never loaded or stored), spilling (56 B, 14 local loads "
            "/ 12 stores), uncounted (16 B)") in out
