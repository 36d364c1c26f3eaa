"""The MLPerf-style audits of ``inferhal qualify`` (core/qualify/audits.py) and the report's environment
manifest: on the reference with a small plan (every audit passes, at level device), and on fake engines that
each break one rule (each audit must catch its own: answers that change with the batch, an answer cache,
streamed counts that disagree with the result, a backend that refuses deterministic=true)."""

from __future__ import annotations

import os
import types

import pytest

from inferhal.core.config.schema import BackendConfig
from inferhal.core.engine.outputs import CompletionOutput, RequestOutput
from inferhal.core.errors import UserError
from inferhal.core.qualify import audits

SMALL = audits.AuditPlan(prompts=2, max_tokens=3, repeats=2, batch_sizes=(3,))


class FakeLLM:
    """A toy engine: tokens from the prompt's sum; one token per step; prefix cache at 16-token blocks.
    ``flaw``: ``batch`` (the first token changes in a batch), ``cache`` (a repeated prompt is answered at once,
    whole), ``stream`` (finish_reason on every streamed output), ``logprobs`` (logprobs change in a batch)."""

    def __init__(self, flaw: str = ""):
        self.flaw, self.seen, self.config = flaw, set(), types.SimpleNamespace(cache=types.SimpleNamespace(block_size=16))
        self.n = 0

    def _answer(self, prompt, sp, batch: int):
        toks = [(sum(prompt) + 7 * i) % 190 for i in range(sp.max_tokens)]
        if self.flaw == "batch" and batch > 1:
            toks[0] = (toks[0] + 1) % 190
        lp = -1.0 - (1e-7 if self.flaw == "logprobs" and batch > 1 else 0.0)
        cached = max((k for k in range(16, len(prompt), 16) if tuple(prompt[:k]) in self.seen), default=0)
        self.seen.update(tuple(prompt[:k]) for k in range(16, len(prompt) + 1, 16))
        return toks, [{t: lp} for t in toks], cached

    def _params(self, prompts, sp):
        return sp if isinstance(sp, list) else [sp] * len(prompts)

    def stream(self, prompts, sp):
        answers, remembered = [], set(self.seen)
        for p, s in zip(prompts, self._params(prompts, sp)):
            answers.append((p, s, *self._answer(p, s, len(prompts))))
        outs = {}
        for j, (p, s, toks, lps, cached) in enumerate(answers):
            self.n += 1
            outs[j] = RequestOutput(str(self.n), None, list(p), [CompletionOutput(0, "", [], None, [])],
                                    num_cached_tokens=cached)
        whole = {j for j, a in enumerate(answers) if self.flaw == "cache" and tuple(a[0][:16]) in remembered}
        for step in range(max(len(a[2]) for a in answers)):
            for j, (p, s, toks, lps, cached) in enumerate(answers):
                o = outs[j]
                if step >= len(toks) or (j in whole and step > 0):
                    continue
                new = toks if j in whole else toks[step:step + 1]
                o.outputs[0].token_ids.extend(new)
                o.outputs[0].logprobs.extend(lps[len(o.outputs[0].logprobs):len(o.outputs[0].token_ids)])
                o.new_token_ids = list(new)
                done = len(o.outputs[0].token_ids) == len(toks)
                o.finished = done
                o.outputs[0].finish_reason = "length" if done or self.flaw == "stream" else None
                yield RequestOutput(o.request_id, None, o.prompt_token_ids,
                                    [CompletionOutput(0, "", list(o.outputs[0].token_ids), o.outputs[0].finish_reason,
                                                      list(o.outputs[0].logprobs))],
                                    finished=done, num_cached_tokens=cached, new_token_ids=list(new))

    def generate(self, prompts, sp):
        finals = {}
        for o in self.stream(prompts, sp):
            if o.finished:
                finals[o.request_id] = o
        return [finals[k] for k in sorted(finals, key=int)]  # input order, as LLM.generate


def fake_run(flaws: dict, refuse: bool = False, plan=SMALL):
    engines = {}

    def make(kind, overrides):
        if refuse and kind in ("deterministic", "alone"):
            raise UserError("deterministic=true: backend 'fake' cannot honour it: its op linear (split-K) declares "
                            "no batch invariance")
        engines[kind] = FakeLLM(flaws.get(kind, ""))
        return engines[kind]

    active = types.SimpleNamespace(name="fake", config=BackendConfig(name="fake"),
                                   profile=types.SimpleNamespace(exec_level=types.SimpleNamespace(value="interpreter")),
                                   ops=types.SimpleNamespace(fallbacks=lambda: ["embed"]))
    rep = audits.run(active, "quick", make=make, plan=plan)
    return {c["name"]: c for c in rep["checks"]}, rep


def test_a_sound_engine_passes_every_audit_and_each_check_states_its_level():
    checks, rep = fake_run({})
    assert {n: c["status"] for n, c in checks.items()} == dict.fromkeys(("TEST01", "TEST04", "TEST06", "determinism"),
                                                                       "pass")
    assert all(c["level"] == "interpreter (+1 reference fallbacks)" for c in checks.values())
    assert "not a hardware result" in checks["TEST04"]["details"]["timing_note"]
    assert rep["honours_deterministic"] is True


@pytest.mark.parametrize("flaws,failing", [
    ({"perf": "batch"}, {"TEST01"}),
    ({"deterministic": "cache"}, {"TEST04"}),
    ({"perf": "stream"}, {"TEST06"}),
    ({"deterministic": "logprobs"}, {"TEST04", "determinism"}),
], ids=["tokens-change-under-load", "answer-cache", "stream-disagrees", "logprobs-change-in-a-batch"])
def test_each_audit_catches_its_flaw(flaws, failing):
    checks, _ = fake_run(flaws)
    assert {n for n, c in checks.items() if c["status"] == "fail"} == failing, {n: c["message"] for n, c in checks.items()}


def test_an_interpreter_run_takes_the_interpreter_plan_and_keeps_every_prefix_case():
    from dataclasses import asdict

    checks, rep = fake_run({}, plan=None)
    assert rep["plan"] == asdict(audits.INTERPRETER_PLANS["quick"])
    cases = [c["case"].split(" (")[0] for c in checks["determinism"]["details"]["cases"]]
    assert cases[-4:] == ["prefix of 1 shared", "prefix of 15 shared", "prefix of 17 shared", "prefix of 35 shared"]
    assert all(c["status"] == "pass" for c in checks.values())


def test_a_backend_that_refuses_deterministic_is_reported_refused_not_failed():
    checks, rep = fake_run({}, refuse=True)
    assert checks["determinism"]["status"] == "refused" and "its op linear" in checks["determinism"]["message"]
    assert checks["TEST04"]["status"] == "pass" and checks["TEST04"]["details"]["compared"] == "tokens"
    assert rep["honours_deterministic"] is False


@pytest.fixture
def one_thread():
    """Correctness only: one intra-op thread (on a shared 2-core host, tiny ops waiting on a second, preempted
    OpenMP thread took 7-20x longer: 52 s against 4 s measured)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_the_reference_passes_every_audit_end_to_end(one_thread):
    from inferhal.core.registry import BackendRegistry

    reg = BackendRegistry.discover()
    rep = audits.run(reg.select(BackendConfig(name="reference")), "quick", plan=SMALL)
    checks = {c["name"]: c for c in rep["checks"]}
    assert {n: c["status"] for n, c in checks.items()} == dict.fromkeys(checks, "pass"), \
        {n: c["message"] for n, c in checks.items()}
    assert all(c["level"] == "device" for c in checks.values())
    cases = checks["determinism"]["details"]["cases"]
    assert cases[1]["case"] == "needle sampled with a seed among a sampled and a greedy request"
    assert [c["case"].split(" (")[0] for c in cases[2:]] == ["prefix of 1 shared", "prefix of 15 shared",
                                                             "prefix of 33 shared", "prefix of 35 shared"]
    assert "cached 32" in cases[-1]["case"]


def test_the_manifest_names_versions_config_hash_and_cpu_flags(tmp_path):
    from omegaconf import OmegaConf

    from inferhal.core.qualify.manifest import config_hash, cpu_info, manifest
    from inferhal.core.registry import BackendRegistry

    cfg = OmegaConf.create({"a": 1, "b": {"c": 2}})
    reg = BackendRegistry.discover()
    m = manifest("cuda_sm100", {"driver": "13000"}, cfg, reg.extra("cuda_sm100", "environment"))
    assert m["torch"][0].isdigit() and m["probe"] == {"driver": "13000"}
    assert m["toolchain"]["triton"][0].isdigit() and "cuda-python" in m["toolchain"]
    assert m["toolchain"]["driver"].startswith(("CUDA ", "absent: no CUDA driver"))
    assert reg.extra("ascend950", "environment")["CANN"].startswith("absent") or "ASCEND_HOME_PATH" in os.environ
    assert "products" in manifest("reference", {}, cfg, reg.extra("reference", "environment"))["toolchain"]
    assert m["backend"]["distribution"] == "inferhal" and m["backend"]["commit"]
    assert m["config_sha256"] == config_hash(OmegaConf.create({"b": {"c": 2}, "a": 1})) != config_hash(
        OmegaConf.create({"a": 2, "b": {"c": 2}}))
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu sse4_2 avx2 avx512f amx_tile fma\n")
    info = cpu_info(str(fake))
    assert info["model"] == "Test CPU" and info["simd_flags"] == ["amx_tile", "avx2", "avx512f", "fma", "sse4_2"]
    assert "no 'environment' extra" in manifest("x", {}, cfg)["toolchain"]["(none)"]
