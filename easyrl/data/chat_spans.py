"""Which tokens of a conversation train: the assistant's, as the chat template itself renders them.

Two ways, both the template's own rendering, never a search for the message text in the rendered string:

* **Generation marks.** A template that wraps the assistant's output in ``{% generation %}`` ... ``{% endgeneration
  %}`` says which characters are the model's; transformers turns them into a token mask
  (``return_assistant_tokens_mask``). Used whenever the template has the marks.
* **Prefix by prefix** (any other template). For assistant message ``i``, the conversation up to it rendered with
  the generation prompt (``messages[:i]``, ``add_generation_prompt=True``) is what the model is shown; the
  conversation through it (``messages[:i + 1]``) ends where its answer ends. The tokens between the two lengths are
  the answer. Both must be prefixes of the whole conversation's rendering, which holds for templates that render a
  turn the same whatever follows it (ChatML, Qwen2.5, Llama 3). A template that rewrites earlier turns once later ones
  follow (Qwen3 drops the reasoning of turns before the last user message) fails that check, and the row is refused
  with the fix: a template with generation marks, or one row per assistant turn. The conversation is tokenized once:
  a prefix that is a text prefix ending on one of its token boundaries (by the fast tokenizer's offsets) takes its
  token count from there; any other is tokenized on its own and must be a token prefix.

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
        text = self.render(conv)
        ids, starts = self._tokens(text)
        mask = [0] * len(ids)
        for turn, message in enumerate(conv.messages):
            if message.get("role") != "assistant":
                continue
            before, through = self.render(conv, turn, generation_prompt=True), self.render(conv, turn + 1)
            # Fast path: both renderings are text prefixes of the conversation and end where one of its tokens ends
            # and the next starts; their token counts are then read off the conversation's own tokens.
            aligned = text.startswith(through) and text.startswith(before) and len(before) < len(through)
            start = starts.get(len(before))
            stop = len(ids) if len(through) == len(text) else starts.get(len(through))
            if not (aligned and start is not None and stop is not None):
                # Otherwise the renderings' own tokens must be prefixes of the conversation's (or the row is refused).
                b, t = (list(x) for x in self.tokenizer([before, through], add_special_tokens=False)["input_ids"])
                start, stop = self._span(ids, b, t, turn)
            end = self._answer_end(ids, start, stop)
            mask[start:end] = [1] * (end - start)
        return ids, mask

    def _tokens(self, text: str) -> tuple[list[int], dict[int, int]]:
        """The text's token ids, and {character offset: token index} of the tokens that start exactly where the one
        before ends (offsets a fast tokenizer reports; none from a slow one, which takes the exact path)."""
        try:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except NotImplementedError:  # a slow (Python) tokenizer has no offsets
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), {}
        offsets = enc["offset_mapping"]
        # A token whose start is not the previous token's end (trimmed whitespace, a byte split mid-character) is no
        # boundary to trust: such a turn takes the exact path.
        starts = {s: k for k, (s, _) in enumerate(offsets) if (offsets[k - 1][1] if k else 0) == s}
        return list(enc["input_ids"]), starts

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
        """[start, end) of assistant message ``turn`` in ``full``: the token counts of the prompt up to it and of the
        conversation through it, each of which must be a token prefix of ``full``."""
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
        return n, m

    def _answer_end(self, ids: list[int], start: int, end: int) -> int:
        """The end of the answer in ``ids[start:end]``: just after its first EOS, if it has one (module docstring)."""
        if self.eos_id is not None and self.eos_id in ids[start:end]:
            return start + ids[start:end].index(self.eos_id) + 1  # the EOS trains: it is how the model stops
        return end
