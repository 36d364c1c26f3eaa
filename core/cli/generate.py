"""``inferhal generate``: one prompt streamed to the terminal, a chat, or a JSONL batch job.

- ``prompt='...'`` (default: :data:`DEFAULT_PROMPT` on the default model) streams tokens as they come
  and ends with a throughput line; ``output=x.json`` also writes its result (text, token ids, finish
  reason) as one JSON object.
- ``prompt_ids=[1,2,3]``: a token-id prompt (a model without a tokenizer, e.g. ``deepseek_v4_tiny``);
  without a tokenizer the generated token ids are printed, space-separated, as they come.
- ``messages=[{role: user, content: ...}]`` goes through the tokenizer's chat template first.
- ``prompts_file=x.jsonl`` (one ``{"prompt": ...}``, ``{"prompt_token_ids": [...]}`` or
  ``{"messages": [...]}`` per line, optional ``"max_tokens"``/``"temperature"``/...): a batch job with a
  rich progress display; results go to ``output=`` as JSONL (else printed), with ``logprobs`` when
  asked for (``sampling.logprobs=k`` or a line's ``"logprobs"``). A bad line is reported with its error
  and the others run.
An empty ``prompt``, ``prompt_ids`` or ``messages`` is an error (no prompt given at all means the default
one); a prompt the engine refuses (e.g. longer than ``model.max_model_len``) fails before it is echoed.
Sampling comes from the ``sampling`` config node (``sampling.max_tokens=32 sampling.temperature=0.7``);
``sampling.logprobs`` only in a batch job (a streamed prompt shows text, so it is refused there).
``parallel.tp * parallel.ep > 1`` (e.g. ``parallel=ep2``) runs the same command on that many ranks
(:mod:`inferhal.core.parallel.ep_generate`); rank 0 prints.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any, Optional, TextIO

from omegaconf import OmegaConf

from inferhal.core.errors import UserError
from inferhal.core.sampling.params import FIELDS, SamplingParams, name_unknown

DEFAULT_PROMPT = "The three most useful things to know about paged attention are"
#: what a prompts_file line may hold besides sampling fields
JOB_KEYS = ("prompt", "prompt_token_ids", "messages", "id")


def sampling_from_cfg(cfg) -> SamplingParams:
    node = OmegaConf.to_container(cfg.sampling, resolve=True) if "sampling" in cfg else {}
    return SamplingParams(**{k: v for k, v in node.items() if k in {f.name for f in dataclasses.fields(SamplingParams)}})


def check_input(cfg) -> SamplingParams:
    """The command's input and sampling settings, refused before any model loads: an empty ``prompt``,
    ``prompt_ids``, ``messages`` or ``prompts_file``, and ``sampling.logprobs`` on a streamed prompt
    (which shows text only). Returns the sampling params."""
    params = sampling_from_cfg(cfg)
    if cfg.get("prompts_file") is not None:
        if not str(cfg.prompts_file):
            raise UserError("prompts_file is empty: pass the path of a JSONL file")
        return params
    if params.logprobs:
        raise UserError(f"sampling.logprobs={params.logprobs}: the streamed output shows text only; ask for "
                        f"logprobs in a batch job (prompts_file=x.jsonl output=y.jsonl), whose rows carry them")
    if cfg.get("messages") is not None and not cfg.messages:
        raise UserError("messages is empty: pass at least one message, e.g. 'messages=[{role: user, content: Hi}]'")
    if cfg.get("messages") is None and cfg.get("prompt_ids") is not None and not cfg.prompt_ids:
        raise UserError("prompt_ids is empty: pass at least one token id, e.g. prompt_ids=[1,2,3]")
    if cfg.get("messages") is None and cfg.get("prompt_ids") is None and cfg.get("prompt") == "":
        raise UserError("prompt is empty: pass some text, e.g. prompt='Hello' (or leave prompt out for the "
                        "default prompt)")
    return params


def generate(cfg, llm: Any = None, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out  # looked up per call: a captured or replaced stdout is honoured
    params = check_input(cfg)
    if llm is None:
        if "parallel" in cfg and int(cfg.parallel.tp) * int(cfg.parallel.ep) > 1:
            from inferhal.core.parallel.ep_generate import generate_parallel

            return generate_parallel(cfg, generate)  # each rank runs generate(cfg, its llm, out)
        from inferhal.core.engine.llm import LLM

        llm = LLM.from_config(cfg)
    if cfg.get("prompts_file") is not None:
        return _batch(llm, cfg.prompts_file, params, cfg.get("output"), out)
    echo = ""
    if cfg.get("messages") is not None:
        if llm.tokenizer is None:
            raise UserError("messages= needs a model with a tokenizer and chat template")
        msgs = OmegaConf.to_container(cfg.messages, resolve=True)
        prompt: Any = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True),
                                           add_bos=False)
    elif cfg.get("prompt_ids") is not None:
        prompt = [int(t) for t in cfg.prompt_ids]
    else:
        prompt = DEFAULT_PROMPT if cfg.get("prompt") is None else str(cfg.prompt)
        if llm.tokenizer is None:
            raise UserError("this model has no tokenizer; pass token ids: prompt_ids=[1,2,3] or a prompts_file "
                            'with {"prompt_token_ids": [...]} per line')
        echo = prompt
    return _stream_one(llm, prompt, params, out, echo, cfg.get("output"))


def _stream_one(llm, prompt, params: SamplingParams, out: TextIO, echo: str = "", output: Optional[str] = None) -> int:
    """Stream one request to ``out``, after ``echo`` (the prompt text); a bad request raises before
    anything is written, and a failure mid-stream first ends the streamed line. ``output``: a file that gets
    the result as one JSON object (the text as streamed, token ids, finish reason, prompt length)."""
    t0 = time.perf_counter()
    first: Optional[float] = None
    n = 0
    final = None
    shown: list[str] = []
    outputs = llm.stream([prompt], params)  # validates the request: a bad one raises before the echo
    out.write(echo)
    line_open = bool(echo)
    try:
        for o in outputs:
            if first is None and o.new_token_ids:
                first = time.perf_counter()
            n += len(o.new_token_ids)
            text = o.new_text if llm.tokenizer is not None else "".join(f" {t}" for t in o.new_token_ids)
            if text and o.finished and o.finish_reason == "stop" and o.new_token_ids and \
                    o.new_token_ids[-1] in llm.engine.eos_token_ids:  # the end-of-turn token is not shown
                eos = llm.tokenizer.decode([o.new_token_ids[-1]])
                text = text[:-len(eos)] if eos and text.endswith(eos) else text
            out.write(text)
            out.flush()
            shown.append(text)
            line_open = line_open or bool(text)
            final = o
    except BaseException:
        if line_open:
            out.write("\n")  # the error message that follows gets a line of its own
            out.flush()
        raise
    dt = time.perf_counter() - t0
    ttft = (first or time.perf_counter()) - t0
    rest = dt - ttft
    decode = f"{(n - 1) / rest:.1f} tok/s decode" if n > 1 and rest > 0 else "no decode steps"
    st = llm.engine.stats
    if st["draft_tokens"]:
        decode += f", {st['accepted_tokens']}/{st['draft_tokens']} {llm.engine.spec_method} drafts accepted"
    out.write(f"\n[{n} tokens in {dt:.2f} s: {n / dt if dt else 0.0:.1f} tok/s, TTFT {ttft * 1000:.0f} ms, {decode}; "
              f"prompt {len(final.prompt_token_ids) if final else 0} tokens; finish: {final.finish_reason if final else None}]\n")
    if output and final is not None:
        with open(output, "w") as f:
            json.dump({"text": "".join(shown), "token_ids": list(final.token_ids), "finish_reason": final.finish_reason,
                       "prompt_tokens": len(final.prompt_token_ids)}, f)
            f.write("\n")
    return 0


def _read_jobs(path: str) -> list[tuple[int, Any]]:
    try:
        with open(path) as f:
            lines = [ln for ln in f.read().splitlines()]
    except OSError as exc:
        raise UserError(f"prompts_file={path!r}: {exc.strerror}") from None
    jobs = []
    for i, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        try:
            jobs.append((i, json.loads(ln)))
        except json.JSONDecodeError as exc:
            jobs.append((i, exc))
    return jobs


def _batch(llm, path: str, params: SamplingParams, output: Optional[str], out: TextIO) -> int:
    from inferhal.core.console import Progress

    eng = llm.engine
    errors, ids = [], {}
    for line, job in _read_jobs(path):
        try:
            if isinstance(job, Exception) or not isinstance(job, dict):
                raise ValueError(f"not a JSON object: {job}")
            extra = {k: v for k, v in job.items() if k not in JOB_KEYS}
            unknown = sorted(set(extra) - set(FIELDS))
            if unknown:
                raise ValueError(f"unknown field(s) {name_unknown(unknown, JOB_KEYS + FIELDS)}; a line takes "
                                 f"{', '.join(JOB_KEYS)} and the sampling fields {', '.join(FIELDS)}")
            p = dataclasses.replace(params, **extra) if extra else params
            if "messages" in job:
                text = llm.tokenizer.apply_chat_template(job["messages"], add_generation_prompt=True)
                prompt = llm.tokenizer.encode(text, add_bos=False)
            elif "prompt_token_ids" in job:
                prompt = job["prompt_token_ids"]
                if not isinstance(prompt, list):
                    raise ValueError('"prompt_token_ids" must be a list of token ids')
            elif "prompt" in job:
                prompt = job["prompt"]
            else:
                raise ValueError('each line needs "prompt", "prompt_token_ids" or "messages"')
            ids[eng.add_request(prompt, p)] = (line, job.get("id", line))
        except (ValueError, TypeError) as exc:
            errors.append({"line": line, "error": str(exc)})
    results, n_tok = {}, 0
    t0 = time.perf_counter()
    with Progress("generate", len(ids)) as prog:
        while eng.has_unfinished():
            for o in eng.step():
                n_tok += len(o.new_token_ids)
                if o.finished:
                    line, jid = ids[o.request_id]
                    results[o.request_id] = {"id": jid, "line": line, "text": o.text, "token_ids": o.token_ids,
                                             "finish_reason": o.finish_reason}
                    if o.logprobs:  # sampling.logprobs > 0: per generated position, token id -> log-probability
                        results[o.request_id]["logprobs"] = [{str(t): lp for t, lp in pos.items()} for pos in o.logprobs]
                    prog.advance(f"line {line} done")
            dt = time.perf_counter() - t0
            prog.note(f"{n_tok} tokens, {n_tok / dt:.1f} tok/s" if dt else "")
    dt = time.perf_counter() - t0
    rows = [results[r] for r in ids if r in results] + errors
    sink = open(output, "w") if output else out
    try:
        for r in sorted(rows, key=lambda r: r["line"]):
            sink.write(json.dumps(r) + "\n")
    finally:
        if output:
            sink.close()
    out.write(f"[{len(results)} done, {len(errors)} rejected; {n_tok} tokens in {dt:.2f} s: "
              f"{n_tok / dt if dt else 0.0:.1f} tok/s]\n")
    for e in errors:
        print(f"inferhal: prompts_file line {e['line']}: {e['error']}", file=sys.stderr)
    return 0 if not errors else 1
