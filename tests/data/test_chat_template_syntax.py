"""A model whose chat template does not parse (a hand-edited chat_template.jinja, a tokenizer_config.json from
another tool): with --apply-chat-template every row had been refused as if the row were wrong ("row 1: field
'input': the chat template refused the messages: Expected an expression"). Now the template is compiled before any
row is read and named as the model's; a caller that renders anyway (a server's chat endpoint) says the same.

The property: for a template cut or spliced anywhere, `template_syntax_problem` names a problem exactly when
transformers cannot compile it, and rendering such a template fails only with a `ChatTemplateError` saying it is
the template's, never with a library's error."""

from __future__ import annotations

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.utils.chat_template_utils import _compile_jinja_template

from relax.data.chat_template import ChatTemplateError, apply_template, template_syntax_problem
from tests.support.tiny_assets import CHATML, QWEN3_TEMPLATE, build_tokenizer

TEMPLATES = (CHATML, QWEN3_TEMPLATE)
JUNK = ("{%", "%}", "{{", "}}", "{% for %}", "{% endif %}", "{% if x %}", "{% generation %}", "|", "(", "'", "")


def _compiles(template: str) -> bool:
    try:
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError:
        return False
    return True


@settings(max_examples=80, deadline=None)
@given(which=st.sampled_from(TEMPLATES), cut=st.floats(0, 1), junk=st.sampled_from(JUNK), at=st.floats(0, 1))
def test_a_damaged_template_is_named_as_the_model_s_exactly_when_it_does_not_compile(which, cut, junk, at):
    template = which[: int(len(which) * cut)]
    position = int(len(template) * at)
    template = template[:position] + junk + template[position:]
    tokenizer = build_tokenizer()
    tokenizer.chat_template = template
    problem = template_syntax_problem(tokenizer)
    assert (problem is None) == _compiles(template), (template, problem)
    if problem is None:
        return
    assert problem.startswith("its chat template does not parse (line ")
    with pytest.raises(ChatTemplateError, match="the model's chat template does not parse .*whatever the messages"):
        apply_template(tokenizer, [{"role": "user", "content": "1+1="}], add_generation_prompt=True)


def test_named_templates_and_none_are_checked_too():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    assert template_syntax_problem(tokenizer) is None
    tokenizer.chat_template = {"default": CHATML, "tool_use": "{% for %}"}
    assert template_syntax_problem(tokenizer) == ("its chat template 'tool_use' does not parse (line 1: Expected an "
                                                  "expression, got 'end of statement block')")
