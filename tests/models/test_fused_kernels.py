"""`worker.actor.model.liger_kernels` (easyrl.models.fused_kernels): Liger's Triton RMSNorm / SwiGLU / RoPE for the
Qwen2 and Qwen3 families. Triton is CUDA only, so on CPU the switch is refused in one line (by the config check and
by the model loader, never dropped); on a GPU it gives the log-probs and gradients of the plain model within bf16
noise (the `gpu` tests; the recipe `liger_kernels` trains with it through vLLM under the numerics gate)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from easyrl.config import ConfigError, load_config
from easyrl.models.fused_kernels import apply_liger_kernels
from easyrl.testing.tiny import build_model, build_tokenizer, make_config, make_tokenizer
from tests.conftest import base_config, write_config


KEY = "worker.actor.model.liger_kernels"


def _model(arch: str) -> Any:
    from easyrl.testing.tiny import _ARCHS

    config = make_config(make_tokenizer(), arch, hidden_size=128, num_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    return _ARCHS[arch][1](config)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_the_switch_is_refused_on_cpu_in_one_line() -> None:
    with pytest.raises(ValueError, match=rf"^{KEY}: Liger's kernels are Triton \(CUDA only\) and this worker has no"):
        apply_liger_kernels(_model("qwen2"), KEY)


def test_another_family_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=rf"^{KEY}: wired for qwen2, qwen3 models only, not llama: set it to false$"):
        apply_liger_kernels(_model("llama"), KEY)


def test_the_config_check_refuses_cpu_and_other_families(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]
) -> None:
    """Before any worker starts: `trainer.device: cpu` (the test config's) and a Llama model, each in one line."""
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    path = write_config(tmp_path / "cfg.yaml", conf)
    with pytest.raises(ConfigError, match=rf"^{KEY}: Liger's kernels are Triton \(CUDA only\) and trainer.device is"):
        load_config(path, [f"{KEY}=true"])
    llama = build_model(tmp_path / "llama", arch="llama", tokenizer=build_tokenizer(tmp_path / "llama"))
    conf = base_config(llama, digits_data, tmp_path / "run")
    path = write_config(tmp_path / "cfg.yaml", conf)
    with pytest.raises(ConfigError, match=rf"^{KEY}: wired for qwen2, qwen3 models only, .* is llama: set it to"):
        load_config(path, [f"{KEY}=true", "trainer.device=cuda"])
    load_config(path, ["trainer.device=cuda"])  # off by default: nothing refused


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel not installed")
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_liger_gives_the_same_log_probs_and_gradients_within_bf16(arch: str) -> None:
    """The plain model and a copy with Liger's kernels, in bf16 on CUDA: the same token log-probs and gradients up to
    bf16 rounding (Liger's RMSNorm keeps the llama casting: fp32 inside, as HF's)."""
    plain = _model(arch).to("cuda", torch.bfloat16)
    fused = copy.deepcopy(plain)
    apply_liger_kernels(fused, KEY)
    # Liger binds its forwards to the loaded model's own modules (instance attributes)
    assert fused.model.layers[0].mlp._get_name() == "LigerSwiGLUMLP" and "forward" in vars(fused.model.norm)
    ids = torch.randint(0, plain.config.vocab_size, (2, 48), device="cuda")
    out = []
    for model in (plain, fused):
        model.zero_grad()
        logits = model(input_ids=ids).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        logp.mean().backward()
        out.append((logp.detach(), model.model.layers[0].mlp.up_proj.weight.grad.float()))
    (logp_a, grad_a), (logp_b, grad_b) = out
    assert (logp_a - logp_b).abs().max().item() < 0.05, (logp_a - logp_b).abs().max()
    assert torch.allclose(grad_a, grad_b, rtol=0.05, atol=1e-3 * grad_a.abs().max().item())
