"""The tool-call parsers (Hermes, DeepSeek's DSML) and the ``<think>`` splitter are cut-invariant: for every
way a text is cut into deltas (one character each, multi-token deltas as MTP and n-gram drafts give, a whole
call in one delta, the whole text in one) they give the same content, calls and reasoning as the text fed
whole. Rendered calls parse back to the same names and arguments, and the content around them comes back
with only the whitespace next to call blocks dropped."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inferhal.core.server.tools import dsml, hermes
from inferhal.core.server.tools.reasoning import CLOSE, OPEN, ThinkSplitter
from inferhal.core.server.tools.scan import Parsed, held

FORMATS = {"hermes": (hermes, hermes.HermesParser), "dsml": (dsml, dsml.DSMLParser)}
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- strategies ------------------------------------------------------------------------------------
NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,9}", fullmatch=True)
PLAIN = st.lists(st.sampled_from(list("ab <>/{}\"\n\t:é,｜") + ["DSML", "tool", "call", "think"]),
                 max_size=20).map("".join)
SCALARS = st.one_of(st.integers(-10**6, 10**6), st.booleans(), st.none(), PLAIN, st.floats(allow_nan=False,
                                                                                           allow_infinity=False))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(NAMES, inner, max_size=3)), max_leaves=6)
ARGS = st.dictionaries(NAMES, VALUES, max_size=4)


def markers(mod) -> list[str]:
    return [mod.START, mod.END] + ([mod.INVOKE_END, '<｜DSML｜invoke name="f">',
                                    '<｜DSML｜parameter name="x" string="true">'] if mod is dsml else [])


def fragments(mod):
    """Text that may hold whole markers, their prefixes, junk calls: anything a model could write."""
    ms = markers(mod)
    return st.lists(st.one_of(PLAIN, st.sampled_from(ms), st.sampled_from(ms).flatmap(
        lambda m: st.integers(1, len(m) - 1).map(lambda n: m[:n])),
        st.tuples(NAMES, ARGS).map(lambda c: mod.render_calls([c]))), max_size=12).map("".join)


def cuts(text: str):
    """``text`` split at random places (hypothesis shrinks towards few, long pieces)."""
    return st.lists(st.integers(0, len(text)), max_size=min(len(text), 24)).map(
        lambda at: [text[a:b] for a, b in zip([0, *sorted(at)], [*sorted(at), len(text)])])


def run(parser, pieces: list[str]):
    """(content, calls, both in their order) of the text fed in ``pieces``: the order of text and calls must not
    depend on the cut either (Anthropic's content blocks keep it)."""
    got = Parsed()
    for p in pieces:
        got += parser.feed(p)
    got += parser.finish()
    order = [x if isinstance(x, str) else (x.name, x.arguments) for x in got.items]
    content, calls = got.content, [(c.name, c.arguments) for c in got.calls]
    return content, calls, order


def canonical(args):
    return json.loads(json.dumps(args))


# -- the properties ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", list(FORMATS))
@SETTINGS
@given(data=st.data())
def test_every_cut_of_any_text_parses_as_the_whole_text(fmt, data):
    mod, Parser = FORMATS[fmt]
    text = data.draw(fragments(mod))
    pieces = data.draw(cuts(text))
    assert "".join(pieces) == text
    assert run(Parser(), pieces) == run(Parser(), [text])
    assert run(Parser(), list(text)) == run(Parser(), [text])  # one character per delta


def _no_markers(mod, s: str) -> bool:
    return not any(m in s for m in (mod.START, mod.END, "<｜DSML｜"))


@pytest.mark.parametrize("fmt", list(FORMATS))
@SETTINGS
@given(data=st.data())
def test_rendered_calls_parse_back_with_the_content_around_them(fmt, data):
    mod, Parser = FORMATS[fmt]
    n = data.draw(st.integers(0, 3))
    blocks = [data.draw(st.lists(st.tuples(NAMES, ARGS), min_size=1, max_size=3)) for _ in range(n)]
    if mod is dsml:  # string="true" values are written raw: one that holds the parameter's end tag cannot be
        blocks = [[(name, {k: v for k, v in a.items() if not (isinstance(v, str) and "</｜DSML｜" in v)})
                   for name, a in b] for b in blocks]
    groups = [data.draw(PLAIN.filter(lambda s: _no_markers(mod, s))) for _ in range(n + 1)]
    text = groups[0] + "".join(mod.render_calls(b) + g for b, g in zip(blocks, groups[1:]))
    want_content = groups[0] if n == 0 else (groups[0].rstrip() + "".join(g.strip() for g in groups[1:-1])
                                             + groups[-1].lstrip())
    want_calls = [(name, canonical(a)) for b in blocks for name, a in b]
    for pieces in (data.draw(cuts(text)), [text], list(text)):
        content, calls, _ = run(Parser(), pieces)
        assert [(nm, canonical(a)) for nm, a in calls] == want_calls
        assert content == want_content


@pytest.mark.parametrize("thinking", [True, False])
@SETTINGS
@given(data=st.data())
def test_think_split_is_the_same_for_every_cut(thinking, data):
    frag = st.one_of(PLAIN, st.sampled_from([OPEN, CLOSE, " ", "\n", OPEN[:3], CLOSE[:4]]))
    text = data.draw(st.lists(frag, max_size=10).map("".join))

    def split(pieces):
        s, r, c = ThinkSplitter(thinking), "", ""
        for p in pieces:
            out = s.feed(p)
            r, c = r + out.reasoning, c + out.content
        out = s.finish()
        return r + out.reasoning, c + out.content

    whole = split([text])
    assert split(data.draw(cuts(text))) == whole and split(list(text)) == whole
    assert len(whole[0]) + len(whole[1]) <= len(text)  # markers consumed, nothing added


NO_TAGS = st.text(st.sampled_from(list("ab />\n:é")), max_size=20)


@given(lead=st.sampled_from(["", " ", "\n\n"]), opener=st.booleans(), reasoning=NO_TAGS, closed=st.booleans(),
       content=st.text(max_size=20))
@SETTINGS
def test_think_split_of_a_well_formed_answer(lead, opener, reasoning, closed, content):
    text = lead + (OPEN if opener else "") + reasoning + (CLOSE + content if closed else "")
    for thinking in (True, False):
        s = ThinkSplitter(thinking)
        a, b = s.feed(text), s.finish()
        got = (a.reasoning + b.reasoning, a.content + b.content)
        if opener:  # the model opened the block: leading whitespace and <think> dropped
            assert got == (reasoning, content if closed else "")
        elif thinking:  # the prompt opened it
            assert got == (lead + reasoning, content if closed else "")
        else:
            assert got == ("", text)


def test_held_keeps_only_a_possible_marker_start():
    assert held("abc<tool_", "<tool_call>") == 6 and held("abc<tool_call", "</tool_call>") == 0
    assert held("x<", "<tool_call>") == 1 and held("x", "<tool_call>") == 0 and held("", "<a>") == 0


def test_peer_failures_a_whole_call_in_one_delta_and_a_stream_in_two_chunks():
    """vLLM issue 48020 (a call lost when it arrives whole in one or two deltas) and SGLang issue 35563 (a
    DeepSeek-V3.2/V4 stream cut in two loses its calls), replayed on both formats."""
    for mod, Parser in FORMATS.values():
        call = mod.render_calls([("get_weather", {"city": "Paris", "days": 3})])
        text = "Let me check." + call
        for pieces in ([text], ["Let me check.", call], [text[:len(text) // 2], text[len(text) // 2:]],
                       ["Let me check." + call[:5], call[5:]]):
            assert run(Parser(), pieces)[:2] == ("Let me check.", [("get_weather", {"city": "Paris", "days": 3})])


def test_malformed_calls_stay_content():
    assert run(hermes.HermesParser(), ['<tool_call>{"name": 3}</tool_call> ok'])[:2] == (
        '<tool_call>{"name": 3}</tool_call> ok', [])
    assert run(hermes.HermesParser(), ['x <tool_call>{"name": "f", "arguments": {"a": 1}}'])[:2] == (
        "x", [("f", {"a": 1})])  # a call cut by the end of the text but complete: kept
    assert run(hermes.HermesParser(), ['x <tool_call>{"name": "f", "argu'])[:2] == ('x <tool_call>{"name": "f", "argu', [])
    bad = '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\nnot a parameter\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    assert run(dsml.DSMLParser(), [bad])[:2] == ('<｜DSML｜invoke name="f">\nnot a parameter\n</｜DSML｜invoke>', [])


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("thinking", [True, False, None])
@SETTINGS
@given(data=st.data())
def test_reasoning_then_calls_is_the_same_for_every_cut(fmt, thinking, data):
    """The server's per-choice parser (the <think> splitter feeding the call parser) is cut-invariant too."""
    from inferhal.core.server.tools.choice import ChoiceParser

    mod, _ = FORMATS[fmt]
    frag = st.one_of(fragments(mod), st.sampled_from([OPEN, CLOSE, " "]))
    text = data.draw(st.lists(frag, max_size=4).map("".join))

    def parse(pieces):
        p = ChoiceParser(thinking, mod)
        for i, piece in enumerate(pieces):
            p.feed(piece, end=i == len(pieces) - 1)
        if not pieces:
            p.feed("", end=True)
        t = p.total
        return t.reasoning, [x if isinstance(x, str) else (x.name, x.arguments) for x in t.items]

    whole = parse([text])
    assert parse(data.draw(cuts(text))) == whole
