"""A cheap lower bound on a text's token count, to drop rows that can never fit before tokenizing them.

Tokenizing a 10 MB row in full takes seconds and gigabytes only to learn it is too long. For byte-level BPE
(Qwen, Llama 3, GPT-2, the test tokenizers) and BPE with byte fallback (Llama 2, Mistral, Gemma), the bound is
exact arithmetic, not an estimate:

* after normalization, every byte of the text ends up inside exactly one token: the ByteLevel alphabet (or the
  `<0x..>` byte-fallback tokens) covers every byte, so nothing is dropped or collapsed into an unknown token,
  provided no pre-tokenizer removes text (checked: only ByteLevel, Metaspace, Digits, Punctuation and Split
  without `removed` are accepted);
* a token covers at most `B` bytes of that text, with `B` the longest vocabulary entry (added tokens included)
  in UTF-8 bytes. A vocabulary entry is never shorter than the text it stands for: a ByteLevel character is one
  input byte but 1-2 UTF-8 bytes, `▁` is 3 bytes for one space, `<0x41>` 6 bytes for one;

so `tokens >= ceil(bytes(normalized text) / B)`. Raw bytes are measured first; the normalizer (NFC can shrink a
text, e.g. Hangul jamo into syllables) runs only when the raw bytes alone say the row cannot fit. For any other
tokenizer (WordPiece, Unigram, WordLevel, BPE with an unknown token: one `[UNK]` may stand for a long word) no such
bound is proven, and `token_lower_bound` returns None: rows are tokenized in full, as before.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "Sequence"}


def _pre_tokenizers(node: dict[str, Any] | None) -> list[dict[str, Any]]:
    if node is None:
        return []
    if node.get("type") == "Sequence":
        return [leaf for child in node.get("pretokenizers", []) for leaf in _pre_tokenizers(child)]
    return [node]


def overlong_checker(tokenizer: Any) -> Callable[[str, int], int | None] | None:
    """`check(text, limit)`: a proven minimum token count of `text` when it exceeds `limit`, else None; or None
    when no bound is proven for this tokenizer (see the module docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    leaves = _pre_tokenizers(spec.get("pre_tokenizer"))
    vocab = tokenizer.get_vocab()
    if model.get("type") != "BPE" or not _covers_every_byte(model, leaves, vocab):
        return None
    if any(p.get("type") not in _KEEPING_PRE_TOKENIZERS or p.get("behavior") == "Removed" for p in leaves):
        return None
    widest = max(len(token.encode("utf-8")) for token in vocab)
    normalizer = backend.normalizer

    def check(text: str, limit: int) -> int | None:
        least = -(-len(text.encode("utf-8")) // widest)
        if least <= limit:
            return None
        if normalizer is not None:  # linear, but only paid by rows the raw size already condemns
            least = -(-len(normalizer.normalize_str(text).encode("utf-8")) // widest)
        return least if least > limit else None

    return check


def _covers_every_byte(model: dict[str, Any], leaves: list[dict[str, Any]], vocab: dict[str, int]) -> bool:
    """Whether every input byte becomes part of a token: the whole ByteLevel alphabet, or all 256 fallback bytes,
    is in the vocabulary (otherwise BPE drops, or folds into an unknown token, what it cannot spell)."""
    from tokenizers.pre_tokenizers import ByteLevel

    if any(p.get("type") == "ByteLevel" for p in leaves) and all(c in vocab for c in ByteLevel.alphabet()):
        return True
    return bool(model.get("byte_fallback")) and all(f"<0x{b:02X}>" in vocab for b in range(256))
