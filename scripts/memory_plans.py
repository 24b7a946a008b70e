"""The memory plans of docs/benchmarks.md: `easyrl.memory_plan` for the published Qwen2.5 shapes (configs
built here, nothing downloaded) at the benchmark's settings (one GPU, fp32 master weights, the KL reference, 16384
tokens per micro-batch), on an H100 80 GB (79.2 GiB as `torch.cuda.mem_get_info` reports it).

    python scripts/memory_plans.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omegaconf import OmegaConf
from transformers import Qwen2_5_VLConfig, Qwen2Config

from easyrl.config import EasyRLConfig
from easyrl.memory_plan import GiB, ModelShape, plan_memory


SHAPES = {"0.5b": (896, 24, 14, 4864), "1.5b": (1536, 28, 12, 8960), "3b": (2048, 36, 16, 11008)}
"""hidden, layers, heads, intermediate of each public config.json (vocabulary 151936, 2 KV heads, tied head)."""
VL_3B_VISION = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 2048,
                "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}  # fmt: skip
ROWS = [("0.5b", 0.5, "adamw", "fp32"), ("1.5b", 0.5, "adamw", "fp32"), ("1.5b", 0.5, "adamw_bf16", "bf16"),
        ("1.5b", 0.4, "adamw", "fp32"), ("3b", 0.5, "adamw_bf16", "fp32"), ("3b", 0.4, "adamw_bf16", "bf16"),
        ("vl-3b", 0.4, "adamw", "fp32"), ("vl-3b", 0.4, "adamw_bf16", "bf16")]  # fmt: skip


def text(model: str) -> dict[str, Any]:
    h, layers, heads, inter = SHAPES[model]
    return {"vocab_size": 151936, "num_key_value_heads": 2, "tie_word_embeddings": True, "hidden_size": h,
            "num_hidden_layers": layers, "num_attention_heads": heads, "intermediate_size": inter}  # fmt: skip


def shape(model: str) -> ModelShape:
    if model == "vl-3b":
        vl = Qwen2_5_VLConfig(text_config=text("3b"), vision_config=VL_3B_VISION, tie_word_embeddings=True)
        return ModelShape.from_hf_config(vl)
    return ModelShape.from_hf_config(Qwen2Config(**text(model)))


def config(utilization: float, optim: str, ref_dtype: str) -> Any:
    sections = {"trainer": {"n_gpus_per_node": 1}, "algorithm": {"disable_kl": False},
                "worker": {"rollout": {"gpu_memory_utilization": utilization},
                           "actor": {"optim": {"strategy": optim}}, "ref": {"fsdp": {"torch_dtype": ref_dtype}}}}  # fmt: skip
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EasyRLConfig), OmegaConf.create(sections)))


def main() -> None:
    device = int(79.2 * GiB)
    print("| model | setting | engine | training state resident (generating) | generating | update (+ref, graphs, "
          "contexts) | KV tokens |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for model, utilization, optim, ref_dtype in ROWS:
        plan = plan_memory(shape(model), config(utilization, optim, ref_dtype), device)
        resident = plan.generating - plan.engine - plan.per_process
        cells = [plan.engine, resident, plan.generating, plan.updating]
        print(f"| {model} | util {utilization}, {optim}, ref {ref_dtype} | "
              + " | ".join(f"{c / GiB:.1f}" for c in cells) + f" | {plan.kv_cache_tokens} |")  # fmt: skip


if __name__ == "__main__":
    main()
