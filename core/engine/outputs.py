"""What the engine returns per request: plain dataclasses, vLLM-shaped (``out.outputs[0].text``) with
the first completion's fields also on the request output (``out.text``, ``out.token_ids``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


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
