"""The dtype names a config uses (`bf16`, `fp16`, `fp32`) and the torch dtypes they stand for: one table for the
trainer, the rollout engines and `easyrl merge`."""

from __future__ import annotations

import torch


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
