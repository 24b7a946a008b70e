"""Turning a data row into the chat-templated prompt text.

Two templates are involved:

* the *prompt template* (``data.format_prompt``, a jinja file) turns a row into the user message; the prompt column
  is available as ``content`` and every column by its own name (``{{ content }}``, ``{{ level }}``, ...);
* the *chat template* (the tokenizer's, or ``data.override_chat_template``) wraps the conversation in the model's
  special tokens; it is applied with ``add_generation_prompt=True`` so the text ends where the answer starts.

A prompt column that already holds a conversation (a list of ``{"role", "content"}`` messages) is used as is.
"""

from __future__ import annotations

import os
from typing import Any

import jinja2

from easyrl.data.template_guard import GuardedEnvironment, TemplateLimitError, render_with_deadline


__all__ = [
    "PromptError",
    "PromptRenderer",
    "UnsafeTemplateError",
    "check_messages",
    "load_chat_template",
    "load_prompt_template",
]


class PromptError(ValueError):
    """A row cannot be rendered into a prompt (bad messages, a template referencing a missing column...)."""


class UnsafeTemplateError(ValueError):
    """The prompt template reached for Python internals the sandbox forbids: a property of the file, not a row."""


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise FileNotFoundError(f"{what} {path} cannot be read: {exc}") from exc


def load_prompt_template(path: str) -> jinja2.Template:
    """Compile the jinja prompt template at ``path``.

    Undefined names are errors (``StrictUndefined``): a typo in a column name must not silently render as an
    empty string in every prompt. The template is user input, so it runs in jinja's immutable sandbox (as
    transformers runs chat templates): no access to dunder attributes (``cycler.__init__.__globals__.os``) and
    no mutating methods, so a template cannot reach the interpreter; and no operation may grow text past
    ``MAX_RENDER_CHARS`` (``easyrl.data.template_guard``).
    """
    text = _read_text(path, "prompt template (data.format_prompt)")
    # The sandbox with size checks on every operation that multiplies text (see `template_guard`).
    env = GuardedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=False, autoescape=False)
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"prompt template {path}: syntax error on line {exc.lineno}: {exc.message}") from exc
    except TemplateLimitError as exc:  # a constant expression too large, found while compiling
        raise UnsafeTemplateError(f"prompt template {path} (data.format_prompt): {exc}") from exc


def load_chat_template(value: str | None) -> str | None:
    """The chat template text from ``data.override_chat_template``: inline jinja text or a path to a file.

    Text containing jinja markers (``{{`` or ``{%``) is taken as the template itself; anything else must be an
    existing file.
    """
    if value is None or not value.strip():
        return None
    if "{{" in value or "{%" in value:
        return value
    if os.path.isfile(value):
        return _read_text(value, "chat template (data.override_chat_template)")
    raise FileNotFoundError(
        f"data.override_chat_template: {value!r} is neither a jinja template (no '{{{{' or '{{%') nor an existing file"
    )


def check_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Return ``messages`` if each is a ``{"role", "content"}`` dict with text or list content, else raise."""
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise PromptError(f"message {position} of the prompt is not a {{'role', 'content'}} dict")
        if not isinstance(message["content"], str | list):
            raise PromptError(f"message {position} has content of type {type(message['content']).__name__}")
    return messages


class PromptRenderer:
    """Renders rows into chat-templated prompt text.

    Args:
        tokenizer: a Hugging Face tokenizer (or processor) with ``apply_chat_template``.
        prompt_key: the column holding the prompt.
        format_prompt: path to the jinja prompt template, or ``None`` to use the prompt column as the message.
        chat_template: a chat template overriding the tokenizer's (text, see :func:`load_chat_template`).
        template_kwargs: extra variables every rendering of the chat template gets (`data.chat_template_kwargs`,
            e.g. ``enable_thinking``).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_key: str = "prompt",
        format_prompt: str | None = None,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.prompt_key = prompt_key
        self.template = load_prompt_template(format_prompt) if format_prompt else None
        self.template_path = format_prompt
        self.chat_template = chat_template
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template; set data.override_chat_template (inline jinja or a .jinja file)"
            )

    def messages(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """The conversation for ``row``: its own message list, or one user message from the prompt template."""
        prompt = row[self.prompt_key]
        if isinstance(prompt, list):
            return check_messages(prompt)
        if self.template is None:
            return [{"role": "user", "content": prompt}]
        # Columns first, then `content`, so a column literally named "content" cannot shadow the prompt.
        variables = {**row, "content": prompt}
        try:
            text = render_with_deadline(self.template, variables)
        except TemplateLimitError as exc:  # stops the run: a template that explodes on one row is no prompt format
            raise UnsafeTemplateError(
                f"prompt template {self.template_path} (data.format_prompt): {exc}; a prompt template should only "
                "format the row's columns"
            ) from exc
        except jinja2.exceptions.SecurityError as exc:
            raise UnsafeTemplateError(
                f"prompt template {self.template_path} (data.format_prompt) does something the sandbox forbids: "
                f"{exc}; templates may only format the row's columns"
            ) from exc
        except jinja2.UndefinedError as exc:
            raise PromptError(f"prompt template: {exc.message}") from exc
        except Exception as exc:  # a template error is a property of the row (e.g. a filter on a bad value)
            raise PromptError(f"prompt template failed: {type(exc).__name__}: {exc}") from exc
        return [{"role": "user", "content": text}]

    def render(self, row: dict[str, Any]) -> str:
        """The prompt text for ``row`` with the chat template applied and the generation prompt appended."""
        messages = self.messages(row)
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=True,
                chat_template=self.chat_template,
                **self.template_kwargs,
            )
        except Exception as exc:
            raise PromptError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(text, str):
            raise PromptError(f"chat template returned {type(text).__name__}, expected text")
        return text
