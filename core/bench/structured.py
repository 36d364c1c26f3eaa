"""``inferhal bench structured``: what structured outputs cost and how often they close, on a real model.

For ``model`` (default Gemma 3 270M; ``model=smollm2_135m_instruct`` for the chat model) on the selected
backend, in one run: the 22 JSON schemas of the test suite (bounded strings, enums, patterns, ranges, nested
objects, arrays, optional fields, anyOf) as 32 requests at concurrency 32 (the first 10 twice; and the first 4
one at a time, concurrency 1, for the per-step cost alone), greedy, then sampled at temperature 0.8, then both
with n-gram drafts (drafting at every batch size): outputs that parse and validate (``jsonschema``), outputs
cut by ``bench.max_tokens`` before the JSON closed (finish reason ``length``), and the per-step time of the
constraint against the whole step: ``fill`` is the time to fill the bitmask (on a side thread, beside the
model's forward), ``mask`` the part of it the step waited out plus applying it (the engine's ``mask_s``); plus
the same prompts unconstrained for the step time without it. Table and JSON under ``bench.output_dir`` (or ``output=``).
"""

from __future__ import annotations

import json
import time

from inferhal.core.bench import write_json


def _run(llm, prompts, params, concurrency: int) -> dict:
    try:
        import jsonschema
    except ImportError:
        from inferhal.core.errors import UserError

        raise UserError("bench structured validates outputs with jsonschema: pip install jsonschema") from None

    eng = llm.engine
    for k in ("steps", "mask_s", "fill_s", "sample_s", "model_s"):
        eng.stats[k] = 0 if k == "steps" else 0.0
    drafted0, accepted0 = eng.scheduler.num_draft_tokens, eng.scheduler.num_accepted_tokens
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), concurrency):
        outs += llm.generate(prompts[i:i + concurrency], params[i:i + concurrency])
    wall = time.perf_counter() - t0
    valid = cut = invalid = 0
    for p, o in zip(params, outs):
        c = o.outputs[0]
        if p.structured is None:
            continue
        if c.finish_reason == "length":
            cut += 1
            continue
        try:
            jsonschema.validate(json.loads(c.text), p.structured.json)
            valid += 1
        except Exception:
            invalid += 1
    s = eng.stats
    steps = max(int(s["steps"]), 1)
    return {"valid": valid, "cut": cut, "invalid": invalid, "steps": steps, "wall_s": wall,
            "step_ms": 1e3 * wall / steps, "mask_ms_per_step": 1e3 * s["mask_s"] / steps,
            "fill_ms_per_step": 1e3 * s["fill_s"] / steps,
            "drafted": eng.scheduler.num_draft_tokens - drafted0, "accepted": eng.scheduler.num_accepted_tokens - accepted0,
            "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}


def run(cfg) -> int:
    from rich.table import Table

    from inferhal import LLM, SamplingParams
    from inferhal.core.console import console as make_console

    console = make_console(min_width=120)
    from inferhal.core.bench.structured_schemas import PROMPTS as prompts, SCHEMAS as schemas

    model = str(cfg.model.name)
    n = len(schemas)
    ps = [prompts[i % len(prompts)] for i in range(n)]
    mt = int(cfg.bench.max_tokens) if int(cfg.bench.max_tokens) != 32 else 96
    llm = LLM.from_config(cfg)  # the model as configured (model=NAME and its fields) on backend.name
    # grammars compile once per schema (then cached): timed apart, so the per-step numbers are the steady state
    from inferhal.core.structured.params import StructuredOutputs

    compiler, compile_ms = llm.engine.grammars(), []
    for s in schemas:
        t0 = time.perf_counter()
        compiler.compile(StructuredOutputs(json=s))
        compile_ms.append(1e3 * (time.perf_counter() - t0))
    compile_ms.sort()
    console.print(f"[structured] compile per schema: median {compile_ms[len(compile_ms) // 2]:.0f} ms, max "
                  f"{compile_ms[-1]:.0f} ms (vocabulary {llm.engine.model.vocab_size:,})", highlight=False)
    rows = []
    for conc in (1, 32):
        k = 4 if conc == 1 else 32  # one at a time: a few schemas give the per-step cost; 32: every schema, 10 twice
        sch, pr = [schemas[i % n] for i in range(k)], [ps[i % n] for i in range(k)]
        cases = [("unconstrained", [SamplingParams(max_tokens=mt, temperature=0.0) for _ in sch], llm),
                 ("greedy", [SamplingParams(max_tokens=mt, temperature=0.0, structured={"json": s}) for s in sch], llm),
                 ("sampled T=0.8", [SamplingParams(max_tokens=mt, temperature=0.8, seed=i, structured={"json": s})
                                    for i, s in enumerate(sch)], llm)]
        if conc > 1:
            drafting = LLM(loaded_model=llm.engine.loaded, active_backend=llm.engine.backend,
                           overrides=["spec=ngram", "spec.disable_by_batch_size=0"])
            cases.append(("greedy + ngram drafts", cases[1][1], drafting))
            cases.append(("sampled T=0.8 + ngram drafts", cases[2][1], drafting))
        for name, params, eng in cases:
            r = _run(eng, pr, params, conc)
            r.update(model=model, concurrency=conc, mode=name, max_tokens=mt, schemas=k)
            rows.append(r)
            console.print(f"[structured] c={conc} {name}: {r['valid']}/{k} valid, {r['cut']} cut, "
                          f"{r['step_ms']:.0f} ms/step, mask {r['mask_ms_per_step']:.2f} ms/step (fill {r['fill_ms_per_step']:.2f} "
                          f"ms/step beside the model)" + (f", drafts {r['accepted']}/{r['drafted']} accepted" if r["drafted"] else ""),
                          highlight=False)
    t = Table(title=f"structured outputs: {model}, {n} JSON schemas, max_tokens {mt}, backend {cfg.backend.name}")
    for col in ("c", "mode", "schemas", "valid", "cut (length)", "invalid", "ms/step", "fill ms/step", "mask ms/step", "mask share"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    for r in rows:
        t.add_row(str(r["concurrency"]), r["mode"], str(r["schemas"]), str(r["valid"]), str(r["cut"]), str(r["invalid"]),
                  f"{r['step_ms']:.0f}", f"{r['fill_ms_per_step']:.2f}", f"{r['mask_ms_per_step']:.2f}",
                  f"{100 * r['mask_ms_per_step'] / max(r['step_ms'], 1e-9):.1f} %")
    console.print(t)
    path = write_json(cfg, f"structured_{model}.json", {"rows": rows, "compile_ms": compile_ms,
                                                        "note": "one run on a shared 2-core host: ratios within the run"})
    console.print(f"wrote {path}", highlight=False)
    return 0
