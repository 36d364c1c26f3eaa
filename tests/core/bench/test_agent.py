"""``inferhal bench agent``: the sessions (generated from a seed, or a trace with its errors named), what a point
reports from its turns, the drafter replay, the checks naming the field, and a short run of the bench itself
(SmolLM2-135M-Instruct behind an ``inferhal serve`` child with suffix drafts, c=1 and 2), and against
llama.cpp's server where llama-cpp-python is installed."""

from __future__ import annotations

import json

import pytest

from inferhal.core.bench import agent_sessions as sessions_mod
from inferhal.core.bench.agent import _drafter_cost, _medians, check
from inferhal.core.bench.agent_client import TurnResult
from inferhal.core.bench.agent_drafter import replay
from inferhal.core.bench.agent_report import pct, summarize
from inferhal.core.bench.agent_servers import _diff, variant_config
from inferhal.core.cli.main import compose, main
from inferhal.core.errors import UserError
from inferhal.core.spec.ngram import NgramProposer
from inferhal.core.spec.suffix import SuffixProposer


def _gen(seed=0, **kw):
    args = dict(sessions=3, turns=4, system_words=120, tool_result_words=[30, 80], output_tokens=[16, 32],
                think_s=[0.0, 0.2])
    args.update(kw)
    return sessions_mod.generate(seed, **args)


def test_generated_sessions_are_a_function_of_the_seed_and_share_one_system_prompt():
    a, b, c = _gen(0), _gen(0), _gen(1)
    assert a == b and a != c
    assert len(a) == 3 and all(len(s.turns) == 4 for s in a) and len({s.system for s in a}) == 1
    assert '"name": "read_file"' in a[0].system and len(a[0].system.split()) >= 120  # tool schemas as text
    assert a[0].turns[0].content.startswith("Task 1") and a[0].turns[1].content.startswith("Tool result")
    assert {t.max_tokens for s in a for t in s.turns} <= {16, 32} and {t.think_s for s in a for t in s.turns} <= {0, 0.2}
    x, y = a[0].salted("aa"), a[0].salted("bb")
    assert x.system != y.system and x.system.endswith(a[0].system) and x.turns == a[0].turns


def test_a_trace_is_read_and_a_bad_line_is_named(tmp_path):
    good = tmp_path / "t.jsonl"
    good.write_text(json.dumps({"session": "a", "system": "sys", "content": "do it", "max_tokens": 8}) + "\n\n"
                    + json.dumps({"session": "b", "content": "x", "max_tokens": 4, "think_s": 0.5}) + "\n"
                    + json.dumps({"session": "a", "content": "result", "max_tokens": 8, "answer": "ok"}) + "\n")
    got = sessions_mod.load_trace(str(good))
    assert [s.name for s in got] == ["a", "b"] and got[0].system == "sys" and got[1].system == ""
    assert [t.content for t in got[0].turns] == ["do it", "result"] and got[0].turns[1].answer == "ok"
    assert got[1].turns[0].think_s == 0.5
    for line, words in [("{", "line 1: not JSON"), ('{"session": "a", "content": "c"}', "'max_tokens' must be"),
                        ('{"session": "a", "content": "c", "max_tokens": 1, "colour": 1}', "unknown field"),
                        ('{"session": "", "content": "c", "max_tokens": 1}', "'session' must be"),
                        ('{"session": "a", "content": "c", "max_tokens": 1, "think_s": -1}', "'think_s' must be"),
                        ("[1]", "expected a JSON object")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text(line + "\n")
        with pytest.raises(UserError, match=words):
            sessions_mod.load_trace(str(bad))
    with pytest.raises(UserError, match="cannot read"):
        sessions_mod.load_trace(str(tmp_path / "missing.jsonl"))


def _turn(start, ttft, gaps, tokens, prompt=100, error=""):
    r = TurnResult(0, "s", 0, start=start, prompt_tokens=prompt, output_tokens=tokens, usage=True, error=error)
    if not error:
        r.first = start + ttft
        r.times = [r.first]
        for g in gaps:
            r.times.append(r.times[-1] + g)
        r.end = r.times[-1] + 0.01
    return r


def test_a_point_reports_latencies_throughput_goodput_and_the_server_counters():
    res = [_turn(0.0, 0.5, [0.1] * 4, 5), _turn(1.0, 1.5, [0.2, 0.2], 6), _turn(2.0, 0.2, [], 1),
           _turn(3.0, 0, [], 0, error="APIError: 400")]
    row = summarize("x", 2, 10.0, res, {"queries": 300, "hits": 240, "drafts": 10, "accepted": 4},
                    slo_ttft_ms=1000, slo_tpot_ms=150)
    assert (row["turns"], row["completed"], row["failed"]) == (4, 3, 1) and row["errors"] == ["APIError: 400"]
    assert row["output_tokens"] == 12 and row["input_tokens"] == 300
    assert row["output_tok_s"] == pytest.approx(1.2) and row["total_tok_s"] == pytest.approx(31.2)
    # TPOT: 0.4 s / 4 = 0.1 and 0.4 s / 5 = 0.08 (the 6-token turn's 3 chunks carried 6 tokens)
    assert row["tpot_ms"]["p50"] == pytest.approx(90.0) and row["tok_s_per_user"] == pytest.approx(1 / 0.09)
    assert row["ttft_ms"]["p50"] == pytest.approx(500.0) and row["itl_ms"]["p99"] == pytest.approx(200.0, abs=1e-6)
    assert row["tokens_per_chunk"] == pytest.approx(12 / 9)  # 5 + 3 + 1 chunks
    assert row["prefix_hit_rate"] == pytest.approx(0.8) and row["acceptance"] == pytest.approx(0.4)
    # goodput: TTFT <= 1 s and TPOT <= 150 ms: the first (0.5 s, 100 ms) and the one-token turn (0.2 s)
    assert row["goodput_req_s"] == pytest.approx(0.2) and row["goodput_tok_s"] == pytest.approx(0.6)
    assert pct([], 50) != pct([], 50) and pct([1.0, 3.0], 50) == 2.0
    assert summarize("x", 1, 1.0, res[:1], None, 1e3, 1e3).get("prefix_hit_rate") is None


def test_rows_are_the_median_repeat_and_ratios_pair_repeats():
    def rep(server, r, tok_s, tpot):
        return {"server": server, "concurrency": 1, "repeat": r, "output_tok_s": tok_s, "tpot_ms": {"p50": tpot},
                "ttft_ms": {"p50": 100.0}, "tokens_per_chunk": 1.0}

    reps = [rep("off", 0, 10.0, 50.0), rep("on", 0, 12.0, 40.0), rep("off", 1, 5.0, 100.0), rep("on", 1, 7.5, 60.0),
            rep("off", 2, 8.0, 60.0), rep("on", 2, 8.0, 60.0)]
    rows, ratios = _medians(reps, ["off", "on"])
    assert [(r["server"], r["repeat"]) for r in rows] == [("off", 2), ("on", 2)]  # 8.0 is each one's median
    assert [x["output_tok_s"] for x in rows[0]["repeats"]] == [10.0, 5.0, 8.0]
    (r,) = ratios  # paired by repeat: 1.2, 1.5, 1.0 and 0.8, 0.6, 1.0
    assert (r["server"], r["baseline"], r["repeats"]) == ("on", "off", 3)
    assert r["output_tok_s"] == pytest.approx(1.2) and r["tpot_p50"] == pytest.approx(0.8) and r["ttft_p50"] == 1.0


def test_the_drafter_replay_times_each_request_step_and_verifies_greedily():
    prompt, out = [1, 2, 3, 4, 5, 6] * 3, [1, 2, 3, 4, 5, 6, 1, 2, 3, 9, 9]
    for prop in (SuffixProposer(k=8), NgramProposer(2, 1, 4)):
        got = replay(prop, [(prompt, out), (prompt, out)])
        assert got["decode_steps"] < 2 * (len(out) - 1)  # drafts stood: fewer steps than tokens
        assert got["accepted"] <= got["drafted"] and got["host_us_p50"] > 0
        assert got["tokens_per_step"] == pytest.approx(2 * (len(out) - 1) / got["decode_steps"])


class _WordTokenizer:
    """A word per token (ids by first appearance): enough for the drafter replay."""

    def __init__(self):
        self.ids = {}

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return " ".join(f"<{m['role']}> {m['content']}" for m in messages) + " <assistant>"

    def encode(self, text, add_bos=False):
        return [self.ids.setdefault(w, len(self.ids)) for w in text.split()]


def test_the_drafter_cost_replays_the_first_servers_turns_at_every_level_through_four_drafters():
    cfg = compose(["model=smollm2_135m_instruct"], command="bench agent")
    answer = "call read_file with path src/a.py then run the tests again and read the output of the tests"

    def row(server, c, n):
        res = []
        for i in range(n):
            r = _turn(float(10 * c + i), 0.1, [0.1], 2)
            r.messages, r.text = [{"role": "user", "content": f"task {i} for user {c}: read src/a.py"}], answer
            res.append(r)
        return {"server": server, "concurrency": c, "_results": res}

    rows = [row("off", 1, 2), row("off", 2, 3), row("suffix", 1, 4)]
    got = _drafter_cost(cfg, rows, _WordTokenizer(), type("Con", (), {"print": lambda *a, **k: None})())
    assert (got["server"], got["turns"]) == ("off", 5)  # the first server's turns at both levels, not suffix's
    assert set(got) == {"server", "turns", "suffix", "suffix_own", "ngram", "ngram_k8"}
    assert got["ngram_k8"]["overrides"][-1] == "spec.num_speculative_tokens=8"  # suffix's k (conf/spec/suffix.yaml)
    for name in ("suffix", "suffix_own", "ngram", "ngram_k8"):
        assert got[name]["decode_steps"] > 0 and got[name]["host_us_p50"] > 0
    # the answer repeats from the second turn on: the recent store drafts it (drafts as long as the match), own
    # tokens hold only the prompt's words, and n-gram drafts at most 2 tokens (conf/spec/ngram.yaml)
    assert got["suffix"]["tokens_per_step"] > got["suffix_own"]["tokens_per_step"]
    assert got["suffix"]["tokens_per_step"] > got["ngram"]["tokens_per_step"]
    assert got["ngram"]["tokens_per_step"] <= 3 and got["ngram"]["drafted"] <= 2 * got["ngram"]["decode_steps"]


@pytest.mark.parametrize("override, words", [
    ("bench.agent.sessions=0", "bench.agent.sessions must be >= 1"),
    ("bench.agent.output_tokens=[]", "bench.agent.output_tokens: needs one or more values"),
    ("bench.agent.think_s=[-1]", "bench.agent.think_s: needs one or more values, each >= 0"),
    ("bench.agent.slo_tpot_ms=0", "bench.agent.slo_tpot_ms must be > 0"),
    ("bench.peers=[transformers]", "bench.peers: bench agent runs the peers"),
])
def test_bench_agent_settings_that_cannot_run_name_the_field(override, words, capsys):
    cfg = compose(["model=smollm2_135m_instruct", override], command="bench agent")
    with pytest.raises(UserError, match=words):
        check(cfg.bench.agent, list(cfg.bench.peers))
    assert main(["bench", "agent", "model=smollm2_135m_instruct", override]) == 2
    assert words.split(":")[0] in capsys.readouterr().err


def test_a_variant_is_this_config_with_what_its_overrides_change():
    cfg = compose(["model=smollm2_135m_instruct", "scheduler.max_num_seqs=7"], command="bench agent")
    got = variant_config(cfg, ["spec=suffix", "spec.num_speculative_tokens=4"])
    assert got.command == "serve" and got.model.name == "smollm2_135m_instruct"
    assert got.scheduler.max_num_seqs == 7 and got.spec.method == "suffix" and got.spec.num_speculative_tokens == 4
    assert got.spec.disable_by_batch_size == 8  # conf/spec/suffix.yaml's
    assert variant_config(cfg, []).spec.method == "none"
    assert _diff({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}}) == [("a.c", 3)]


@pytest.mark.slow
def test_a_short_run_against_an_inferhal_serve_child(tmp_path, capsys):
    """Two sessions of two turns, c=1 and 2, 8 tokens a turn, the child with suffix drafts (~1 min here)."""
    out = tmp_path / "agent.json"
    code = main(["bench", "agent", "model=smollm2_135m_instruct", "model.max_model_len=2048", "bench.concurrency=[1,2]",
                 "bench.warmup=0", "bench.repeats=1", "bench.agent.sessions=2", "bench.agent.turns=2", "bench.agent.turns_per_point=4",
                 "bench.agent.output_tokens=[8]", "bench.agent.think_s=[0]", "bench.agent.tool_result_words=[30]",
                 "bench.agent.system_words=60", "bench.agent.drafter_cost=false",
                 "+bench.agent.variants.suffix=['spec=suffix','spec.disable_by_batch_size=0']", f"output={out}"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    got = json.loads(out.read_text())
    assert [(r["server"], r["concurrency"]) for r in got["rows"]] == [("suffix", 1), ("suffix", 2)]
    for r in got["rows"]:
        assert r["completed"] == r["turns"] == 4 and r["failed"] == 0 and r["tokens_from_usage"]
        assert r["output_tokens"] > 0 and r["input_tokens"] > r["output_tokens"] and r["total_tok_s"] > 0
        assert r["ttft_ms"]["p50"] > 0 and r["prefix_hit_rate"] > 0  # a session's second turn reuses its first
    assert (tmp_path / "agent.png").stat().st_size > 10_000 and "commit" in got["stamp"]
    assert "tok/s/user" in printed and "suffix" in printed and not got["notes"]


@pytest.mark.slow
def test_a_short_run_against_llama_cpp(tmp_path, capsys):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the bench extra) is not installed")
    out = tmp_path / "agent.json"
    code = main(["bench", "agent", "model=smollm2_135m_instruct", "bench.concurrency=[2]", "bench.warmup=0", "bench.repeats=1",
                 "bench.agent.sessions=2", "bench.agent.turns=1", "bench.agent.turns_per_point=2",
                 "bench.agent.output_tokens=[8]", "bench.agent.think_s=[0]", "bench.agent.tool_result_words=[30]",
                 "bench.agent.system_words=60", "bench.agent.drafter_cost=false", "bench.peers=[llama_cpp]",
                 "bench.url=http://127.0.0.1:1", f"output={out}"])
    got = json.loads(out.read_text())
    assert code == 1 and got["notes"]["url"].startswith("not measured")  # nothing at the url: said, exit 1
    (r,) = got["rows"]  # bench.url set and no variants: no inferhal child; the peer alone
    assert r["server"] == "llama_cpp" and r["completed"] == 2
    # two users at once: queued, each turn gets its answer (llama-cpp-python's default cut one off with the other)
    assert all(t["output_tokens"] > 0 for t in r["turn_records"])
    assert r["input_tokens"] > 0 and r["input_tokens_from"].startswith("the bench's tokenizer")  # no usage sent
    assert r.get("prefix_hit_rate") is None and r["tokens_per_chunk"] == 1.0
