"""The engine's CLI commands: generate (stream, chat, JSONL batch), plan kv, bench dispatch."""

from __future__ import annotations

import io
import json

import pytest

from inferhal import LLM
from inferhal.core.cli.main import compose
from inferhal.core.cli.generate import generate
from inferhal.core.errors import UserError


@pytest.fixture(scope="module")
def llm(backend, toy_module):
    return LLM(loaded_model=toy_module.make_toy(backend), active_backend=backend, num_blocks=64, block_size=4)


def test_generate_streams_and_reports_throughput(llm):
    out = io.StringIO()
    assert generate(compose(["prompt=hello", "sampling.max_tokens=6", "sampling.ignore_eos=true"], "generate"), llm, out) == 0
    text = out.getvalue()
    expect = llm.generate(["hello"], llm_params())[0].text
    assert text.startswith("hello" + expect) and "[6 tokens in" in text and "tok/s" in text


def llm_params():
    from inferhal import SamplingParams

    return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_chat_messages_use_the_template(llm):
    out = io.StringIO()
    generate(compose(["+messages=[{role: user, content: hi}]", "sampling.max_tokens=3"], "generate"), llm, out)
    tok = llm.tokenizer
    n = len(tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]), add_bos=False))
    assert f"prompt {n} tokens" in out.getvalue()


def test_jsonl_batch_reports_bad_lines_and_runs_the_rest(llm, tmp_path):
    jobs = tmp_path / "p.jsonl"
    jobs.write_text('{"prompt": "abc"}\n{"prompt": "%s"}\nnot json\n{"prompt": "hi", "bogus": 1}\n'
                    '{"messages": [{"role": "user", "content": "yo"}], "max_tokens": 2}\n' % ("x" * 600))
    res = tmp_path / "out.jsonl"
    rc = generate(compose([f"prompts_file={jobs}", f"output={res}", "sampling.max_tokens=3"], "generate"), llm, io.StringIO())
    rows = [json.loads(x) for x in res.read_text().splitlines()]
    assert rc == 1 and [r["line"] for r in rows] == [1, 2, 3, 4, 5]
    assert "max_model_len" in rows[1]["error"] and "not a JSON object" in rows[2]["error"]
    assert rows[3]["error"].startswith("unknown field(s) 'bogus'; a line takes prompt, prompt_token_ids, messages, id")
    assert len(rows[0]["token_ids"]) <= 3 and len(rows[4]["token_ids"]) <= 2


def test_one_prompt_with_output_writes_its_result_as_json(llm, tmp_path):
    res = tmp_path / "one.json"
    out = io.StringIO()
    assert generate(compose(["prompt=hi", f"output={res}", "sampling.max_tokens=3"], "generate"), llm, out) == 0
    row = json.loads(res.read_text())
    assert len(row["token_ids"]) == 3 and row["finish_reason"] == "length" and row["text"] in out.getvalue()


def test_a_misspelt_job_field_is_named_with_the_field_it_resembles(llm, tmp_path):
    jobs = tmp_path / "p.jsonl"
    jobs.write_text('{"promt": "abc"}\n{"prompt": "hi", "max_tokenz": 2}\n')
    res = tmp_path / "out.jsonl"
    assert generate(compose([f"prompts_file={jobs}", f"output={res}"], "generate"), llm, io.StringIO()) == 1
    errors = [json.loads(x)["error"] for x in res.read_text().splitlines()]
    assert "'promt' (did you mean 'prompt'?)" in errors[0] and "'max_tokenz' (did you mean 'max_tokens'?)" in errors[1]


def test_plan_kv_for_deepseek_v4_configs():
    from inferhal.core.plan.kv import plan_kv

    cfg = compose(["model=deepseek_v4_tiny"], "plan kv")
    plan = plan_kv(cfg.model, 16, 1 << 30)
    assert {g["group"] for g in plan["groups"]} >= {"swa", "csa", "hca"}
    assert plan["bytes_per_token"] == pytest.approx(sum(g["bytes_per_token"] for g in plan["groups"]))
    assert plan["allocated_bytes"] <= 1 << 30 and min(plan["num_blocks"].values()) > 0
    flash = plan_kv(compose(["model=deepseek_v4_flash"], "plan kv").model, 16)
    assert flash["block_size"] % 128 == 0  # raised to fit HCA's 128:1 ratio


@pytest.mark.parametrize("budget,kv_dtype", [(8 << 20, "auto"), (64 << 20, "auto"), (8 << 20, "fp8"), (8 << 20, "fp4")])
def test_plan_kv_allocates_what_the_engine_allocates(budget, kv_dtype):
    """`plan kv` and a running engine split a budget into the same pools and allocate the same bytes."""
    from inferhal.core.plan.kv import plan_kv
    from inferhal.core.engine.llm import LLM

    ov = [f"cache.kv_cache_bytes={budget}", "cache.block_size=16", "model.max_model_len=256",
          f"cache.kv_dtype={kv_dtype}"]
    cfg = compose(["model=deepseek_v4_tiny", *ov], "plan kv")
    plan = plan_kv(cfg.model, 16, budget, cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens,
                   kv_dtype=kv_dtype)
    eng = LLM("deepseek_v4_tiny", backend="reference", overrides=ov).engine
    assert eng.kv_manager.num_blocks == plan["num_blocks"]
    assert eng.kv_storage.nbytes() == plan["allocated_bytes"] <= budget


def test_bench_dispatch_lists_kinds():
    from inferhal.core.cli import cmd_bench

    assert {"e2e", "engine", "eplb", "cpu_linear"} <= set(cmd_bench.kinds())
    assert "host" not in cmd_bench.kinds()  # a helper module, not a benchmark
    with pytest.raises(UserError, match="kinds: .*engine"):
        cmd_bench.run(compose([], "bench nope"), ["nope"])


def test_plan_kv_formats_and_the_v4_1_reading_of_890_bytes():
    from inferhal.core.plan.kv import plan_kv

    v41 = compose(["model=deepseek_v4_1_flash", "cache.kv_dtype=fp4"], "plan kv")  # planning honours kv_dtype
    plan = plan_kv(v41.model, 16, kv_dtype="fp4")
    assert plan["bytes_per_token_full_context"] == 890.0  # 10 source layers x (288 + 68) / 4
    rows = {r["group"]: r for r in plan["groups"]}
    assert rows["csa"]["layers"] == 10 and rows["csa"]["slot_bytes"] == 288 and rows["csa_index"]["slot_bytes"] == 68
    assert rows["swa"]["kind"] == "sliding"  # the window is listed apart, not in the 890
    flash = compose(["model=deepseek_v4_flash"], "plan kv").model
    fp8 = {r["group"]: r for r in plan_kv(flash, 16, kv_dtype="fp8")["groups"]}
    assert fp8["csa"]["slot_bytes"] == 584 and "448 e4m3" in fp8["csa"]["record"]  # vLLM's V4 layout
    auto = plan_kv(flash, 16)
    assert auto["bytes_per_token_full_context"] == 6880.0  # bf16: csa 5376 + csa_index 1344 + hca 160
    with pytest.raises(UserError, match="cache.kv_dtype must be one of auto, fp8, fp4"):
        plan_kv(flash, 16, kv_dtype="int3")
    with pytest.raises(UserError, match="gemma3.* plans only cache.kv_dtype=auto"):
        plan_kv(compose(["model=gemma3_270m"], "plan kv").model, 16, kv_dtype="fp8")


def test_kv_dtype_values_are_checked_when_composed():
    assert compose(["model=deepseek_v4_tiny", "cache.kv_dtype=fp8"], "generate").cache.kv_dtype == "fp8"
    with pytest.raises(UserError, match="cache.kv_dtype='int4' is not a KV format"):
        compose(["model=deepseek_v4_tiny", "cache.kv_dtype=int4"], "generate")
