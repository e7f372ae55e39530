"""A chat request's prompt: its messages checked (text only), then written out by the tokenizer's
chat template (or a plain one), with the variables the chat fields give it."""

from __future__ import annotations

import inspect
import json
from typing import Any

from jinja2 import TemplateError

from distserve.entrypoints.openai_errors import HTTPError

# For tokenizers without a chat template of their own.
DEFAULT_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CHAT_ROLES = ("system", "developer", "user", "assistant")


def chat_prompt(tokenizer, fields: dict[str, Any]) -> str:
    """The prompt text of a chat request's parsed fields."""
    continue_final = fields.get("continue_final_message", False)
    add_generation_prompt = fields.get("add_generation_prompt", not continue_final)
    if continue_final and add_generation_prompt:
        raise HTTPError(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true", param="continue_final_message"
        )
    return render_chat(
        tokenizer,
        _chat_messages(fields["messages"]),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final,
        documents=fields.get("documents"),
        template_kwargs=_template_kwargs(tokenizer, fields),
    )


def _chat_messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise HTTPError("'messages' must be a non-empty list of messages", param="messages")
    messages = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise HTTPError(f"'{where}' must be an object with 'role' and 'content'", param=where)
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise HTTPError(f"'{where}' has an unsupported field '{extra[0]}'", param=f"{where}.{extra[0]}")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise HTTPError(
                f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)}", param=f"{where}.role"
            )
        message = {"role": role, "content": _message_text(m.get("content"), f"{where}.content")}
        if "name" in m:
            if not isinstance(m["name"], str):
                raise HTTPError(f"'{where}.name' must be a string", param=f"{where}.name")
            message["name"] = m["name"]
        messages.append(message)
    return messages


def _message_text(content: Any, where: str) -> str:
    """A message's content as one string: text parts are joined by newlines, as vLLM does."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise HTTPError(
                    f"'{where}' has the part {json.dumps(part)}: only text parts (type 'text' with a string "
                    "'text') are supported",
                    param=where,
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise HTTPError(f"'{where}' must be a string or a list of text parts", param=where)


def render_chat(
    tokenizer,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    documents: list[dict] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text of a conversation, by default ending with the assistant's turn opened."""
    template = None if tokenizer.chat_template else DEFAULT_CHAT_TEMPLATE
    try:
        return tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            documents=documents,
            **(template_kwargs or {}),
        )
    except (TemplateError, ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
        # The request's own values (documents, template variables) reach the template.
        raise HTTPError(f"the chat template refused the messages: {e}", param="messages") from e


def _template_kwargs(tokenizer, fields: dict[str, Any]) -> dict[str, Any]:
    """The chat template's extra variables: chat_template_kwargs and reasoning_effort."""
    kwargs = dict(fields.get("chat_template_kwargs", {}))
    if kwargs:
        reserved = set(inspect.signature(tokenizer.apply_chat_template).parameters) | {"messages", "conversation"}
        clash = sorted(kwargs.keys() & reserved)
        if clash:
            where = f"chat_template_kwargs.{clash[0]}"
            raise HTTPError(f"'{where}' is not a template variable: it is set by its own field", param=where)
    if "reasoning_effort" in fields:
        kwargs["reasoning_effort"] = fields["reasoning_effort"]
    return kwargs
