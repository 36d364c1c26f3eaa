"""What the engine returns per request: plain dataclasses, vLLM-shaped (``out.outputs[0].text``) with
the first completion's fields also on the request output (``out.text``, ``out.token_ids``), and the
:class:`OutputProcessor` that builds them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence


@dataclass
class CompletionOutput:
    """``logprobs[i]`` maps token id → log-probability at generated position ``i``: the top-k of that
    position plus the token actually chosen (empty list unless ``SamplingParams.logprobs > 0``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens not computed at admission (prefix-cache hit)
    num_preemptions: int = 0
    new_token_ids: list[int] = field(default_factory=list)  # tokens since the previous output (streaming)
    new_text: str = ""
    num_replayed_tokens: int = 0  # tokens recomputed only to rebuild sliding windows (paging/replay.py)
    num_draft_tokens: int = 0  # speculative drafts verified for this request (spec.method)
    num_accepted_tokens: int = 0  # of which the target accepted (the tokens they gave may be cut by a stop)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> Optional[str]:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, float]]:
        return self.outputs[0].logprobs


class OutputProcessor:
    """A request's output as the engine reports it: its text (decoded when it finishes, or on every step with
    ``stream_text``; cut before a stop string that ended it; an end-of-sequence token that stopped it is not
    text, as vLLM returns it), its logprobs so far (the tokens a stop dropped drop theirs), and what is new since
    the previous report (streaming deltas). The engine decides nothing here: the scheduler's
    :class:`~inferhal.core.scheduler.stopping.StopChecker` ends requests."""

    def __init__(self, tokenizer: Any, stream_text: bool = False) -> None:
        self.tokenizer, self.stream_text = tokenizer, stream_text
        self._prompts: dict[str, Optional[str]] = {}
        self._logprobs: dict[str, list[dict[int, float]]] = {}
        self._sent: dict[str, int] = {}  # tokens already reported
        self._text: dict[str, str] = {}

    def track(self, request_id: str, prompt: Optional[str], logprobs: Sequence[dict] = (), sent: int = 0) -> None:
        """Start reporting ``request_id`` (``logprobs``/``sent``: what another engine already gave and reported)."""
        self._prompts[request_id], self._logprobs[request_id] = prompt, list(logprobs)
        self._sent[request_id] = sent

    def forget(self, request_id: str) -> None:
        for d in (self._prompts, self._logprobs, self._sent, self._text):
            d.pop(request_id, None)

    def logprobs(self, request_id: str) -> list[dict[int, float]]:
        return self._logprobs.get(request_id, [])

    def record(self, logprobs: Mapping[str, Any]) -> None:
        """A step's logprobs: one position's dict per request, or a list (accepted drafts plus one)."""
        for rid, lp in logprobs.items():
            if rid in self._logprobs:  # else finished before this step was folded in (asynchronous scheduling)
                (self._logprobs[rid].extend if isinstance(lp, list) else self._logprobs[rid].append)(lp)

    def output(self, req: Any) -> RequestOutput:
        rid, toks = req.request_id, req.output_token_ids
        lps = self._logprobs.get(rid, [])
        del lps[len(toks):]  # a stop among accepted drafts dropped the tokens after it
        text = ""
        if self.tokenizer is not None and (req.is_finished or self.stream_text):
            eos_end = req.is_finished and bool(toks) and toks[-1] in req.eos_token_ids and not req.params.ignore_eos
            text = self.tokenizer.decode(toks[:-1] if eos_end else toks)
            if req.finish_reason == "stop" and req.params.stop:
                cut = min((text.find(s) for s in req.params.stop if s in text), default=-1)
                if cut >= 0:
                    text = text[:cut]
        prev, prev_text = self._sent.get(rid, 0), self._text.get(rid, "")
        new_text = text[len(prev_text):] if text.startswith(prev_text) else text
        self._sent[rid], self._text[rid] = len(toks), text
        out = RequestOutput(rid, self._prompts.get(rid), list(req.prompt_token_ids),
                            [CompletionOutput(0, text, list(toks), req.finish_reason, list(lps))],
                            finished=req.is_finished, num_cached_tokens=req.num_cached_tokens,
                            num_preemptions=req.num_preemptions, new_token_ids=list(toks[prev:]), new_text=new_text,
                            num_replayed_tokens=req.num_replayed_tokens, num_draft_tokens=req.num_draft_tokens,
                            num_accepted_tokens=req.num_accepted_tokens)
        if req.is_finished:
            self.forget(rid)
        return out
