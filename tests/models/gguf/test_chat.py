"""Chat templates (Jinja, as a GGUF or ``model.chat_template`` carries them) render in a sandbox with the
checked messages, and every failure is a UserError."""

from __future__ import annotations

import pytest

from inferhal.core.errors import UserError
from inferhal.core.models.gguf.chat import render

TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}{{ eos_token }}")


def test_a_template_renders_the_messages_and_the_special_tokens():
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "extra": 1}]
    assert render(msgs, TEMPLATE, True, bos_token="<bos>") == "<bos>[user]x[assistant]y>"
    assert render(msgs[:1], TEMPLATE, False, "<s>", "</s>") == "<s>[user]x</s>"


def test_template_runs_in_a_sandbox():
    bad = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(UserError):
        render([{"role": "user", "content": "x"}], bad)


@pytest.mark.parametrize("template,match", [
    (None, "has no chat template: set model.chat_template"),
    ("{{ raise_exception('only user turns') }}", "chat template: only user turns"),
    ("{% for %}", "chat template failed to render")])
def test_missing_raising_or_broken_templates_are_user_errors(template, match):
    with pytest.raises(UserError, match=match):
        render([{"role": "user", "content": "x"}], template)


def test_roles_outside_the_families_are_refused():
    with pytest.raises(UserError, match="role is 'model'"):
        render([{"role": "model", "content": "x"}], TEMPLATE)
    assert render([{"role": "model", "content": "x"}], TEMPLATE, roles=("user", "model")) == "[model]x>"
