"""The step thread's time in KV tier saves, synchronous against asynchronous (#51, core/paging/copy_worker.py).

Two engines over one model, each with a host tier (``cache.host_tier_bytes``) on a pool too small to keep the
sessions: ``sync`` runs every save on the step thread before the step, as the tiers were first built
(``KVOffload(asynchronous=False)``: gather + host tier put), ``async`` hands them to the copy worker. Each repeat
runs the same sessions (a turn of ``prompt`` random tokens, ``others`` other prompts that evict its blocks, then
the next turn on its whole history) on both engines, the order alternating by repeat, and records per engine the
step thread's seconds in saves (``save_s``), the seconds the saves took wherever they ran (``store_s``), the time
allocations and steps waited for saves (``store_wait_s``), the steps' busy time and the prompt tokens found cached
(pinned blocks are freed later, which may move the pool's evictions); the ratio async / sync is
taken per repeat and its median reported. Both engines' tokens must be equal (else the run fails).

``python -m inferhal.core.bench.kv_tiers_copies [model] [repeats] [prompt] [json] [override ...]`` (overrides
replace the tiny DeepSeek-V4's defaults, e.g. ``cache.block_size=16`` alone for another model).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from typing import Any

from inferhal.core.sampling.params import SamplingParams

FIELDS = ("save_s", "store_s", "store_wait_s", "saved_bytes")


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, vocab) for _ in range(n)]


def _engines(model: str, blocks: int, overrides: list[str]) -> dict[str, Any]:
    from inferhal.core.engine.llm import LLM

    out = {}
    for mode in ("sync", "async"):
        llm = LLM(model, backend="reference", overrides=overrides + [f"cache.num_blocks={blocks}",
                                                                     "cache.host_tier_bytes=4294967296"])
        llm.engine.kv_offload.worker.inline = mode == "sync"  # = KVOffload(asynchronous=False)
        out[mode] = llm
    return out


def _session(llm: Any, repeat: int, prompt: int, others: int, vocab: int, params: SamplingParams) -> tuple:
    """→ (every request's tokens, prompt tokens found cached)."""
    turn1 = _prompt(prompt, 1000 * repeat, vocab)
    outs = [llm.generate([turn1], params)[0]]
    for k in range(others):
        outs.append(llm.generate([_prompt(prompt, 1000 * repeat + 1 + k, vocab)], params)[0])
    outs.append(llm.generate([turn1 + outs[0].token_ids + _prompt(prompt // 8, 1000 * repeat + 99, vocab)],
                             params)[0])
    return [o.token_ids for o in outs], sum(o.num_cached_tokens for o in outs)


def measure(model: str = "deepseek_v4_tiny", repeats: int = 5, prompt: int = 300, others: int = 3,
            overrides: list[str] | None = None) -> dict[str, Any]:
    overrides = list(overrides if overrides is not None else
                     ["model.max_model_len=1280", "model.arch.max_position_embeddings=2048", "cache.block_size=16"])
    blocks = 2 * (-(-prompt // 16)) + 2  # two requests' worth: the others evict the first turn's blocks
    engines = _engines(model, blocks, overrides)
    vocab = min(200, int(getattr(engines["sync"].engine.model, "vocab_size", 200) or 200))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    _session(engines["sync"], 999, 64, 1, vocab, params), _session(engines["async"], 999, 64, 1, vocab, params)
    runs: list[dict[str, Any]] = []
    for rep in range(repeats):
        rec: dict[str, Any] = {}
        order = ("sync", "async") if rep % 2 == 0 else ("async", "sync")
        for mode in order:
            eng = engines[mode].engine
            before, busy0, t0 = eng.kv_offload.stats(), eng.executor.busy_s, time.perf_counter()
            tokens, cached = _session(engines[mode], rep, prompt, others, vocab, params)
            wall = time.perf_counter() - t0
            eng.kv_offload.flush()
            after = eng.kv_offload.stats()
            rec[mode] = {k: after[k] - before[k] for k in FIELDS}
            rec[mode].update(busy_s=eng.executor.busy_s - busy0, wall_s=wall, tokens=tokens, cached_tokens=cached)
        if rec["sync"]["tokens"] != rec["async"]["tokens"]:
            raise AssertionError(f"repeat {rep}: the asynchronous saves changed the tokens")
        rec["ratio_save_s"] = rec["async"]["save_s"] / max(rec["sync"]["save_s"], 1e-12)
        runs.append(rec)
    med = {mode: {k: statistics.median(r[mode][k] for r in runs) for k in (*FIELDS, "busy_s", "wall_s")}
           for mode in ("sync", "async")}
    for llm in engines.values():
        llm.engine.kv_offload.close()
    return {"model": model, "repeats": repeats, "prompt": prompt, "others": others, "pool_blocks": blocks,
            "median": med, "median_ratio_save_s": statistics.median(r["ratio_save_s"] for r in runs),
            "runs": [{m: {k: v for k, v in r[m].items() if k != "tokens"} for m in ("sync", "async")}
                     | {"ratio_save_s": r["ratio_save_s"]} for r in runs]}


def main(argv: list[str]) -> int:
    model = argv[0] if argv else "deepseek_v4_tiny"
    repeats = int(argv[1]) if len(argv) > 1 else 5
    prompt = int(argv[2]) if len(argv) > 2 else 300
    from inferhal.core.bench.stamp import stamp

    res = measure(model, repeats, prompt, overrides=argv[4:] or None)
    res["stamp"] = stamp()  # commit, date, host, command (docs/perf/README.md)
    text = json.dumps(res, indent=1)
    if len(argv) > 3:
        with open(argv[3], "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
