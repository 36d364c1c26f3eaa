"""End-to-end golden outputs: greedy token ids of small models through the engine's LLM API, recorded on
the reference backend in ``golden_tokens.json`` (``python -m inferhal.core.qualify.golden [MODEL ...]``
regenerates all or the named models) and compared, token for token, on the qualified backend.

Each model has the lowest qualify level that runs it: the tiny DeepSeek-V4 (random weights, token-id
prompts) runs at ``quick``; Gemma 3 270M (the real GGUF checkpoint, text prompts through its own
tokenizer) only at ``qualify=full``, since loading and generating take tens of seconds on a CPU and far
longer in a kernel interpreter. At a lower level it is listed as skipped, never as passed.
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).with_name("golden_tokens.json")
LEVELS = ("quick", "full")
MODELS = {
    "deepseek_v4_tiny": {"prompts": [[1, 5, 9, 42, 7, 3], [11, 2, 77, 30]], "max_tokens": 8, "level": "quick"},
    "gemma3_270m": {"prompts": ["The capital of France is", "def fibonacci(n):"], "max_tokens": 12, "level": "full"},
}


def _generate(model: str, spec: dict, backend: str, interpret: bool) -> list[list[int]]:
    from inferhal.core.engine.llm import LLM
    from inferhal.core.sampling.params import SamplingParams

    llm = LLM(model=model, backend=backend, overrides=[f"backend.interpret={str(bool(interpret)).lower()}"])
    outs = llm.generate(spec["prompts"], SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0))
    return [list(o.token_ids) for o in outs]


def run(cfg, active) -> list[dict]:
    if not DATA.exists():
        return [{"name": m, "status": "not-run", "message": f"no golden data ({DATA.name} missing)"} for m in MODELS]
    data = json.loads(DATA.read_text())
    level = active.profile.exec_level.value
    n_fallback = len(active.ops.fallbacks())
    qlevel = str(cfg.qualify.level)
    rows = []
    for model, gold in data.items():
        row = {"name": model, "level": level + (f" (+{n_fallback} reference fallbacks)" if n_fallback else "")}
        need = gold.get("level", "quick")
        if LEVELS.index(need) > LEVELS.index(qlevel):
            row.update(status="skipped", message=f"runs at qualify={need} only (qualify={qlevel} here)")
            rows.append(row)
            continue
        try:
            got = _generate(model, gold, active.name, bool(active.config.interpret))
        except Exception as exc:  # the engine or a model piece failed: a readable failure
            row.update(status="fail", message=f"{type(exc).__name__}: {exc}")
            rows.append(row)
            continue
        matched = sum(a == b for g, w in zip(got, gold["tokens"]) for a, b in zip(g, w))
        total = sum(len(w) for w in gold["tokens"])
        row.update(matched=f"{matched}/{total}", status="pass" if got == gold["tokens"] else "fail",
                   message="" if got == gold["tokens"] else f"got {got}, golden {gold['tokens']}")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    """Record the golden token ids on the reference backend (all models, or those named in ``argv``)."""
    import sys

    names = list(sys.argv[1:] if argv is None else argv) or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"unknown golden model(s) {unknown}; known: {', '.join(MODELS)}")
    data = json.loads(DATA.read_text()) if DATA.exists() else {}
    for m in names:
        data[m] = {**MODELS[m], "tokens": _generate(m, MODELS[m], "reference", False)}
    DATA.write_text(json.dumps({m: data[m] for m in MODELS if m in data}, indent=1) + "\n")
    print(f"wrote {DATA} ({', '.join(names)})")


if __name__ == "__main__":  # pragma: no cover
    main()
