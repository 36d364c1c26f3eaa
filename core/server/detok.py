"""A choice's text as its tokens arrive, and OpenAI's logprob shapes.

Each choice decodes its tokens without special tokens; while it runs, text that could still be cut (a
trailing partial UTF-8 character, the last ``len(longest stop) - 1`` characters) is held back, so the
streamed deltas joined equal the non-stream text.
"""

from __future__ import annotations

from typing import Optional


class Detokenizer:
    """One choice's text: :meth:`push` while it runs, :meth:`finish` with its last tokens."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tok, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = ""
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.matched_stop: Optional[str] = None  # the stop string that ended the text, if one did

    def _text(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        safe = self._text().rstrip("\ufffd")
        safe = safe[:max(0, len(safe) - self.hold)] if self.hold else safe
        if len(safe) > len(self.sent) and safe.startswith(self.sent):
            delta, self.sent = safe[len(self.sent):], safe
            return delta
        return ""

    def finish(self, ids: list[int], reason: Optional[str]) -> str:
        self.ids.extend(ids)
        text = self._text()
        if reason == "stop" and self.stop:
            hits = [(text.find(s), s) for s in self.stop if s in text]
            if hits:
                cut, self.matched_stop = min(hits)
                text = text[:cut]
        delta = text[len(self.sent):] if text.startswith(self.sent) else text
        self.sent = text
        return delta

    def step(self, d) -> str:
        """The text a :class:`~.async_engine.Delta` adds."""
        return self.finish(d.token_ids, d.finish_reason) if d.finished else self.push(d.token_ids)


def logprob_entries(tok, ids: list[int], lps: list[dict[int, float]], k: int) -> list[dict]:
    """Chat completions' ``logprobs.content`` entries for ``ids`` (``k`` alternatives each)."""
    out = []
    for t, lp in zip(ids, lps):
        s = tok.decode([t])
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
        out.append({"token": s, "logprob": float(lp.get(t, float("-inf"))), "bytes": list(s.encode("utf-8")),
                    "top_logprobs": [{"token": tok.decode([i]), "logprob": float(v),
                                      "bytes": list(tok.decode([i]).encode("utf-8"))} for i, v in top]})
    return out


def completion_logprobs(entries: list[dict], offset: int) -> dict:
    """The legacy completions ``logprobs`` object for ``entries`` whose text starts at ``offset``."""
    offsets, pos = [], offset
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}
