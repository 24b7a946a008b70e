"""The value model (critic) of a vision-language policy.

transformers maps no ``*ForTokenClassification`` class to the Qwen2.5-VL / Qwen3-VL configs, so the critic of a VL
policy is built here: the checkpoint's backbone (vision tower and language model, loaded with ``AutoModel``; the LM
head is left out) and a one-output linear head on every token, initialised like transformers' token-classification
heads. Its forward takes what the actor's forward takes (patches, grids, 3D positions, ``mm_token_type_ids``) and
returns ``logits`` of shape (b, L, 1), so the critic worker treats text and VL critics alike.

An Omni thinker has no backbone class of its own: its audio merge and its audio-aware 3D positions live in its
``*ForConditionalGeneration`` forward (``AutoModel`` maps no thinker config). Its critic (:class:`ThinkerValueModel`)
is that class with the LM head replaced by an identity, so the forward's ``logits`` are the last hidden states, under
the same value head.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import TokenClassifierOutput


__all__ = ["ThinkerValueModel", "VisionValueModel"]


class VisionValueModel(nn.Module):
    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.model = backbone
        config: Any = backbone.config
        self.config = config
        text: Any = getattr(config, "text_config", config)
        self.score = nn.Linear(int(text.hidden_size), 1)
        nn.init.normal_(self.score.weight, std=float(getattr(text, "initializer_range", 0.02)))
        nn.init.zeros_(self.score.bias)
        dtype = next(backbone.parameters()).dtype
        self.score.to(dtype)
        # What FSDP wrapping reads to find the blocks to shard (decoder layers and vision blocks).
        self._no_split_modules = list(getattr(backbone, "_no_split_modules", None) or [])

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> VisionValueModel:
        """The backbone of the VL checkpoint at ``path`` (``kwargs`` go to ``AutoModel.from_pretrained``) plus a new
        value head."""
        from transformers import AutoModel

        return cls(AutoModel.from_pretrained(path, **kwargs))

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        self.model.gradient_checkpointing_enable(**kwargs)  # type: ignore[operator]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        use_cache: bool = False,
        **media: Any,
    ) -> TokenClassifierOutput:
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache, **media
        )
        return TokenClassifierOutput(logits=self.score(self.last_hidden(out)))

    def last_hidden(self, out: Any) -> torch.Tensor:
        """The backbone's last hidden states in its output."""
        return out.last_hidden_state


class ThinkerValueModel(VisionValueModel):
    """The critic of an Omni thinker: the thinker with an identity for its LM head, plus the value head."""

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> ThinkerValueModel:
        from transformers import AutoModelForImageTextToText

        thinker = AutoModelForImageTextToText.from_pretrained(path, **kwargs)
        # No (V, H) head on every token's hidden state: the value head reads them as they are. The thinker's tied-head
        # key names a module that is gone; nothing re-ties it after loading.
        thinker.lm_head = nn.Identity()
        return cls(thinker)

    def last_hidden(self, out: Any) -> torch.Tensor:
        return out.logits  # the identity head's output
