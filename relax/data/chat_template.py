"""Turn a dataset prompt (a string or a list of chat messages) into the text the model sees."""

from __future__ import annotations

from typing import Any


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
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        messages = list(prompt)
    else:
        raise ValueError("expected a string or a list of {role, content} messages")
    if system_prompt and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("--apply-chat-template is set but the tokenizer has no chat template")
    if tools and "tools" not in tokenizer.chat_template:  # it would drop them silently
        raise ValueError("the row offers tools but the tokenizer's chat template does not render `tools`")
    tool_kwargs = {"tools": tools} if tools else {}  # calls without tools stay exactly as before
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **tool_kwargs, **(template_kwargs or {})
    )
