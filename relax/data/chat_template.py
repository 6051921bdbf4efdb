"""Turn a dataset prompt (a string or a list of chat messages) into the text the model sees."""

from __future__ import annotations

from typing import Any

import jinja2

# Arguments of `apply_chat_template` that Relax sets for each call or that change what the call returns: given as
# template variables (`--apply-chat-template-kwargs`, a row's ``metadata.apply_chat_template_kwargs``, a client's
# ``chat_template_kwargs``) they would break the call or its result instead of reaching the template.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class ChatTemplateError(ValueError):
    """The tokenizer's chat template refused the messages (its ``raise_exception``) or could not render them."""


def template_kwargs_problem(kwargs: Any, reserved_too: frozenset[str] = frozenset()) -> str | None:
    """Why ``kwargs`` cannot be a chat template's extra variables, or None when they can; ``reserved_too`` names
    more arguments a caller does not take (a server does not run a client's own ``chat_template``)."""
    if not isinstance(kwargs, dict):
        kind = "null" if kwargs is None else type(kwargs).__name__
        return f"must be an object of template variables (e.g. {{\"enable_thinking\": false}}), got {kind}"
    reserved = sorted((RESERVED_TEMPLATE_KWARGS | reserved_too).intersection(kwargs))
    if reserved:
        return (f"{', '.join(map(repr, reserved))} {'is an argument' if len(reserved) == 1 else 'are arguments'} "
                "that Relax sets for each call, not a template variable")
    return None


def template_syntax_problem(tokenizer: Any) -> str | None:
    """Why the tokenizer's chat template cannot be compiled (a syntax error of the model folder's
    chat_template.jinja or tokenizer_config.json), None when it can or there is none. Compiled as transformers
    compiles it (its extensions: ``{% generation %}``, loop controls), once: transformers caches the result."""
    templates = getattr(tokenizer, "chat_template", None)
    if isinstance(templates, str):
        templates = {"": templates}
    if not isinstance(templates, dict):
        return None
    from transformers.utils.chat_template_utils import _compile_jinja_template

    for name, template in templates.items():
        try:
            _compile_jinja_template(template)
        except jinja2.TemplateSyntaxError as err:
            which = f"chat template {name!r}" if name else "chat template"
            return f"its {which} does not parse (line {err.lineno}: {err.message})"
    return None


def apply_template(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """``tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)``; what the template does with messages
    it cannot render (a ``raise_exception`` of its own, content of a type it does not expect) becomes a
    `ChatTemplateError` naming the reason, so a caller reports it as bad input rather than a crash."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except jinja2.TemplateSyntaxError as err:  # the model's template, whatever the messages
        raise ChatTemplateError(f"the model's chat template does not parse (line {err.lineno}: {err.message}), "
                                "whatever the messages") from None
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"the chat template refused the messages: {err}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as err:
        raise ChatTemplateError(f"the chat template cannot render the messages ({type(err).__name__}: {err})") from None


def render_prompt(
    prompt: str | list[dict[str, Any]],
    tokenizer: Any,
    apply_chat_template: bool,
    system_prompt: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text. Without the chat template a prompt must be a plain string; with it, a
    string becomes one user message, ``system_prompt`` is put first, and the template adds the
    generation prompt and renders ``tools`` (OpenAI-style function specs) the way the model was
    trained to see them."""
    if not isinstance(prompt, (str, list)):
        kind = "null" if prompt is None else type(prompt).__name__
        raise ValueError(f"a prompt is a string or a list of {{role, content}} messages, got {kind}")
    if not apply_chat_template:
        if not isinstance(prompt, str):
            raise ValueError("a message-list prompt needs --apply-chat-template")
        if tools:
            raise ValueError("tools are shown to the model by the chat template: set --apply-chat-template")
        return prompt
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                     for m in prompt):
        messages = list(prompt)
    else:
        raise ValueError("expected a string or a non-empty list of {role, content} messages (each role a string)")
    if system_prompt and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("--apply-chat-template is set but the tokenizer has no chat template")
    if tools and "tools" not in tokenizer.chat_template:  # it would drop them silently
        raise ValueError("the row offers tools but the tokenizer's chat template does not render `tools`")
    problem = template_kwargs_problem(template_kwargs or {})
    if problem:
        raise ValueError(f"apply_chat_template_kwargs {problem}")
    tool_kwargs = {"tools": tools} if tools else {}  # calls without tools stay exactly as before
    return apply_template(tokenizer, messages, add_generation_prompt=True, **tool_kwargs, **(template_kwargs or {}))
