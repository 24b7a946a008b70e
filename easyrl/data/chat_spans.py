"""Which tokens of a conversation train: the assistant's, as the chat template itself renders them.

Two ways, both the template's own rendering, never a search for the message text in the rendered string:

* **Generation marks.** A template that wraps the assistant's output in ``{% generation %}`` ... ``{% endgeneration
  %}`` says which characters are the model's; transformers turns them into a token mask
  (``return_assistant_tokens_mask``). Used whenever the template has the marks.
* **Prefix by prefix** (any other template). For assistant message ``i``, the conversation up to it rendered with
  the generation prompt (``messages[:i]``, ``add_generation_prompt=True``) is what the model is shown; the
  conversation through it (``messages[:i + 1]``) ends where its answer ends. The tokens between the two lengths are
  the answer. Both must be token prefixes of the whole conversation's rendering, which holds for templates that
  render a turn the same whatever follows it (ChatML, Qwen2.5, Llama 3). A template that rewrites earlier turns once
  later ones follow (Qwen3 drops the reasoning of turns before the last user message) fails that check, and the row
  is refused with the fix: a template with generation marks, or one row per assistant turn.

Departure: on the prefix path the answer ends at its first end-of-sequence token. What the template renders after
it (ChatML's newline after ``<|im_end|>``) is never generated (a rollout stops at EOS) and is not trained; the demo's
warm start trains the answer and its EOS alone, as this does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


__all__ = ["ChatRenderer", "Conversation", "SpanError", "TemplateMaskError", "has_generation_marks"]

_GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")


class SpanError(ValueError):
    """A row cannot be rendered (the template raised on it): a property of the row."""


class TemplateMaskError(ValueError):
    """The chat template cannot mark this conversation's assistant tokens: a property of the template, which stops the
    run naming the row and the fix."""


def has_generation_marks(template: str) -> bool:
    """Whether the chat template marks the assistant's output with ``{% generation %}``."""
    return bool(_GENERATION_MARK.search(template))


@dataclass(frozen=True)
class Conversation:
    """One row's messages and tools, as the chat template takes them."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


class ChatRenderer:
    """Renders conversations with a tokenizer's chat template (or an override) and marks their assistant tokens.

    Args:
        tokenizer: a Hugging Face tokenizer with ``apply_chat_template`` (a fast one for generation marks).
        chat_template: a template replacing the tokenizer's (``data.override_chat_template``), or None.
        template_kwargs: extra template variables (``data.chat_template_kwargs``, e.g. ``enable_thinking``).
    """

    def __init__(self, tokenizer: Any, chat_template: str | None, template_kwargs: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_kwargs = dict(template_kwargs)
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if not template or not isinstance(template, str):
            raise ValueError(
                "the tokenizer has no chat template; set data.override_chat_template (inline jinja or a .jinja file)"
            )
        self.generation_marks = has_generation_marks(template)
        self.eos_id: int | None = getattr(tokenizer, "eos_token_id", None)

    def render(self, conv: Conversation, upto: int | None = None, generation_prompt: bool = False) -> str:
        """The text of ``conv.messages[:upto]`` (all by default), optionally ending in the generation prompt."""
        messages = conv.messages if upto is None else conv.messages[:upto]
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=conv.tools,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                chat_template=self.chat_template,
                **self.template_kwargs,
            )
        except Exception as exc:  # a template error is a property of the row (a missing field, a bad role...)
            raise SpanError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(text, str):
            raise SpanError(f"chat template returned {type(text).__name__}, expected text")
        return text

    def encode(self, conv: Conversation) -> tuple[list[int], list[int]]:
        """(token ids, assistant mask) of the conversation's whole rendering; mask 1 on every assistant token.

        Raises:
            SpanError: the template failed on this row.
            TemplateMaskError: the template cannot mark this row's assistant tokens.
        """
        if self.generation_marks:
            return self._marked(conv)
        turns = [i for i, m in enumerate(conv.messages) if m.get("role") == "assistant"]
        texts = [self.render(conv)]
        for i in turns:
            texts += [self.render(conv, i, generation_prompt=True), self.render(conv, i + 1)]
        # one tokenizer call for the row's texts (the Rust tokenizer batches them)
        encoded = [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        full, mask = encoded[0], [0] * len(encoded[0])
        for k, i in enumerate(turns):
            start, end = self._span(full, encoded[1 + 2 * k], encoded[2 + 2 * k], i)
            mask[start:end] = [1] * (end - start)
        return full, mask

    def _marked(self, conv: Conversation) -> tuple[list[int], list[int]]:
        try:
            out = self.tokenizer.apply_chat_template(
                conv.messages,
                tools=conv.tools,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                chat_template=self.chat_template,
                **self.template_kwargs,
            )
        except Exception as exc:
            raise SpanError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        ids, mask = list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
        if not any(mask):
            raise TemplateMaskError(
                "the chat template's {% generation %} marks cover no token of this conversation: put them around "
                "the assistant's content in the template"
            )
        return ids, mask

    def _span(self, full: list[int], before: list[int], through: list[int], turn: int) -> tuple[int, int]:
        """[start, end) of assistant message ``turn`` in ``full``: between the prompt up to it and the conversation
        through it, cut after the first EOS (see the module docstring)."""
        n, m = len(before), len(through)
        if full[:m] == through and m <= n:
            raise TemplateMaskError(
                f"the chat template renders no tokens for message {turn} (an assistant turn) beyond the generation "
                "prompt: it does not render assistant messages; set data.override_chat_template to one that does"
            )
        if full[:n] != before or full[:m] != through:
            raise TemplateMaskError(
                f"the chat template renders message {turn} (an assistant turn) differently once later turns follow "
                "(as Qwen3's drops earlier turns' reasoning), so its tokens cannot be found by rendering the "
                "conversation prefix by prefix: set data.override_chat_template to a template whose assistant "
                "output sits in {% generation %} ... {% endgeneration %}, or give each assistant turn a row of its own"
            )
        end = m
        if self.eos_id is not None and self.eos_id in full[n:m]:
            end = n + full[n:m].index(self.eos_id) + 1  # the EOS trains: it is how the model stops
        return n, end
