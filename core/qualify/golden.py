"""End-to-end golden outputs: greedy token ids of the tiny models through the engine's LLM API,
recorded on the reference backend in ``golden_tokens.json`` (``python -m inferhal.core.qualify.golden``
regenerates it) and compared, token for token, on the qualified backend.

Gemma 3 270M is not in the set yet: loading it takes over a minute on the CPU machines.
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).with_name("golden_tokens.json")
MODELS = {"deepseek_v4_tiny": {"prompts": [[1, 5, 9, 42, 7, 3], [11, 2, 77, 30]], "max_tokens": 8}}


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
    rows = []
    for model, gold in data.items():
        row = {"name": model, "level": level + (f" (+{n_fallback} reference fallbacks)" if n_fallback else "")}
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


def main() -> None:
    """Record the golden token ids on the reference backend."""
    data = {m: {**spec, "tokens": _generate(m, spec, "reference", False)} for m, spec in MODELS.items()}
    DATA.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {DATA}")


if __name__ == "__main__":  # pragma: no cover
    main()
