"""``inferhal bench deterministic``: what ``deterministic=true`` costs, and a check that it holds.

For ``model`` on ``backend``: two engines, one with the mode off and one with it on (the model is loaded
once for each: the op tables differ), greedy decoding of ``bench.max_tokens`` tokens for ``c`` prompts at each
``bench.concurrency`` level, the two modes interleaved ``bench.repeats`` times after ``bench.warmup`` rounds;
output tok/s as medians and the cost as the ratio off/on within the run. The check: in the deterministic
engine, prompt 0's tokens and logprobs at every concurrency and in every round are bitwise those of prompt 0
alone (and whether the off engine's are, for contrast). Table and JSON under ``bench.output_dir`` (or ``output=``).
"""

from __future__ import annotations

import statistics
import time

from inferhal.core.bench import write_json

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three laws of thermodynamics are", "A haiku about the sea:", "SELECT name FROM users WHERE",
           "The quick brown fox", "In 1969, the first humans"]


def _round(llm, prompts, sp) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall, outs


def run(cfg) -> int:
    from rich.table import Table

    from omegaconf import OmegaConf

    from inferhal import LLM, SamplingParams
    from inferhal.core.console import console as make_console

    console = make_console(min_width=110)
    model, backend = str(cfg.model.name), str(cfg.backend.name)
    b = cfg.bench
    levels, mt = [int(c) for c in b.concurrency], int(b.max_tokens)
    engines = {}
    for mode in ("off", "on"):
        console.print(f"[deterministic] loading {model} on {backend}, mode {mode}", highlight=False)
        each = cfg.copy()  # the model as configured (model=NAME and its fields), the mode set here
        OmegaConf.update(each, "deterministic", mode == "on", merge=False)
        engines[mode] = LLM.from_config(each)
    sp = SamplingParams(max_tokens=mt, temperature=0.0, logprobs=1, ignore_eos=True)
    text = engines["off"].tokenizer is not None
    vocab = int(engines["off"].engine.model.vocab_size)

    def prompt(i: int):  # text, or token ids for a model without a tokenizer
        if text:
            return PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" ({i})")
        return [(7 * i + 13 * j) % (vocab - 1) + 1 for j in range(8 + 3 * (i % 8))]

    alone = {m: e.generate([prompt(0)], sp)[0].outputs[0] for m, e in engines.items()}
    rows = []
    for c in levels:
        prompts = [prompt(i) for i in range(c)]
        speeds = {"off": [], "on": []}
        same = {}
        for r in range(int(b.warmup) + int(b.repeats)):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                tps, outs = _round(engines[mode], prompts, sp)
                if r >= int(b.warmup):
                    speeds[mode].append(tps)
                o = outs[0].outputs[0]
                same[mode] = same.get(mode, True) and (o.token_ids == alone[mode].token_ids  # every round
                                                        and o.logprobs == alone[mode].logprobs)
        row = {"concurrency": c, "off_tok_s": statistics.median(speeds["off"]),
               "on_tok_s": statistics.median(speeds["on"]), "runs": speeds,
               "on_bitwise_equal_alone": same["on"], "off_bitwise_equal_alone": same["off"]}
        row["cost"] = row["off_tok_s"] / row["on_tok_s"]
        rows.append(row)
        console.print(f"[deterministic] c={c}: off {row['off_tok_s']:.1f} tok/s, on {row['on_tok_s']:.1f} tok/s "
                      f"({row['cost']:.2f}x slower); prompt 0 equal to alone: on {same['on']}, off {same['off']}",
                      highlight=False)
    t = Table(title=f"deterministic=true: {model} {cfg.model.dtype} on {backend}, greedy, {mt} tokens, median of "
                    f"{b.repeats}")
    for col in ("c", "off tok/s", "on tok/s", "cost (off/on)", "on: = alone", "off: = alone"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["concurrency"]), f"{r['off_tok_s']:.1f}", f"{r['on_tok_s']:.1f}", f"{r['cost']:.2f}x",
                  str(r["on_bitwise_equal_alone"]), str(r["off_bitwise_equal_alone"]))
    console.print(t)
    path = write_json(cfg, f"deterministic_{model}_{backend}_{cfg.model.dtype}.json",
                      {"rows": rows, "model": model, "backend": backend, "dtype": str(cfg.model.dtype),
                       "max_tokens": mt, "note": "one run on a shared 2-core host: ratios within the run"})
    console.print(f"wrote {path}", highlight=False)
    return 0 if all(r["on_bitwise_equal_alone"] for r in rows) else 1
