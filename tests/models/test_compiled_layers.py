"""`worker.actor.model.compile_layers` (easyrl.models.compiled_layers): `torch.compile` per decoder layer.

On CPU (inductor's C++ backend) the compiled layers give the eager model's log-probs and gradients within float
tolerance, on the padded and the packed (padding-free) layout, over micro-batches of three different lengths without
a recompile after the first; the parameter names (checkpoints, merge, weight sync) stay the Hugging Face ones; and
the switch is refused in one line where it cannot work. A `gpu` test does the same in bf16 on CUDA. `extended`:
one step end to end through `easyrl train` with the switch on (FSDP2 over 2 gloo workers; ~3.5 min here), and
Llama, Qwen3 MoE, Qwen3.5 MoE and Qwen2.5-VL compiled against eager. Qwen3.5 compiles around its linear attention
(kept eager). The rest takes ~50 s warm (inductor's on-disk cache), ~3
min cold on this loaded 2-core machine (~65 CPU-s): kept in `make test`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from easyrl.config import ConfigError, load_config
from easyrl.models.compiled_layers import compile_decoder_layers, compiled_layers
from easyrl.workers.head import token_log_probs
from easyrl.workers.model_setup import iter_full_weights
from easyrl.workers.packing import packed_attn_implementation
from easyrl.workers.specs import ForwardOptions
from tests.conftest import base_config, train_steps, write_config
from tests.workers.test_packing import make_batch, tiny_lm


KEY = "worker.actor.model.compile_layers"
LENGTHS = ((4, 10), (3, 14), (5, 7))
"""(responses, max response length) of the three micro-batches: three token counts, three shapes."""


def _log_probs_and_grads(model: torch.nn.Module, mb: Any, opts: ForwardOptions, device: str = "cpu") -> Any:
    model.zero_grad()
    lp, _ = token_log_probs(model, mb.to(device), torch.device(device), 1.0, False, opts)
    lp.float().sum().backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach().float(), grads


@pytest.mark.parametrize("layout", ["padded", "packed_checkpointed"])
def test_compiled_layers_give_the_eager_log_probs_and_gradients(layout: str) -> None:
    """fp32 on CPU: inductor fuses the RMSNorm, SwiGLU and RoPE arithmetic and reorders its sums, so results move
    by fp32 rounding only (seen: ~5e-7 on log-probs of size ~6); atol 1e-5 / rtol 1e-4 leaves room for that and
    would catch any real difference (a wrong mask, a dropped term: orders of magnitude more). The packed layout runs
    with gradient checkpointing, as padding-free training does by default: the recompute replays the compiled
    layer."""
    packed = layout != "padded"
    eager = tiny_lm().train()
    if packed:
        eager.config._attn_implementation = packed_attn_implementation()
        eager.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compiled = copy.deepcopy(eager)
    names = [n for n, _ in compiled.named_parameters()]
    torch._dynamo.reset()
    counters.clear()
    assert compile_decoder_layers(compiled, KEY) == 2
    opts = ForwardOptions(padding_free=packed)
    graphs = []
    for i, (b, r) in enumerate(LENGTHS):
        mb = make_batch(b=b, p=12, r=r, seed=i)
        ref_lp, ref_grads = _log_probs_and_grads(eager, mb, opts)
        lp, grads = _log_probs_and_grads(compiled, mb, opts)
        mask = mb["response_mask"].bool()
        torch.testing.assert_close(lp[mask], ref_lp[mask], atol=1e-5, rtol=1e-4)
        assert grads.keys() == ref_grads.keys() and len(grads) == len(names)
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, atol=1e-5, rtol=1e-4, msg=name)
        graphs.append(counters["stats"]["unique_graphs"])
    # compiled at all, and no recompile for the later lengths: dynamic shapes, the packed attention kept out
    assert graphs[0] >= 1 and graphs == [graphs[0]] * len(LENGTHS), graphs
    # padded: one graph for both layers; packed: the layer before and after the attention (and their resumptions)
    assert graphs[0] <= (1 if not packed else 4), graphs
    # in-place compilation: no `_orig_mod.` in any name a checkpoint, a merge or the weight stream reads
    assert [n for n, _ in compiled.named_parameters()] == names
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert [n for n, _ in iter_full_weights(compiled, aliases=True)] == [
        n for n, _ in iter_full_weights(eager, aliases=True)
    ]


def test_a_model_without_decoder_layers_is_refused_in_one_line() -> None:
    model = tiny_lm()
    model._no_split_modules = []  # e.g. remote code that names no layer class to keep whole
    assert compiled_layers(model) == []
    with pytest.raises(ValueError, match=rf"^{KEY}: no decoder layers found in Qwen2ForCausalLM to compile: set it"):
        compile_decoder_layers(model, KEY)


def test_the_config_check_refuses_liger_together(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]
) -> None:
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    path = write_config(tmp_path / "cfg.yaml", conf)
    load_config(path, [f"{KEY}=true"])  # alone, on CPU: accepted
    with pytest.raises(ConfigError, match=rf"^{KEY}: and worker.actor.model.liger_kernels both fuse RMSNorm"):
        load_config(path, [f"{KEY}=true", "worker.actor.model.liger_kernels=true", "trainer.device=cuda"])


def _tiny(family: str, tmp_path: Path) -> str:
    from easyrl.testing.families import build_tiny_family

    kw = {"num_heads": 2, "num_kv_heads": 1} if family != "qwen2_5_vl" else {}
    return str(build_tiny_family(tmp_path / family, family, **kw))


def _compiled_against_eager(path: str, batches: list[Any] | None = None) -> None:
    """The tiny model at `path`, packed, its decoder layers compiled against the same weights eager: log-probs and
    every gradient within fp32 tolerance over three micro-batch lengths, no recompile after the first. Two loads of
    the same folder (a deep copy would do too: tests/models/test_linear_attention.py)."""
    from easyrl.config import ModelConfig
    from easyrl.workers.model_setup import load_model

    def load() -> torch.nn.Module:
        return load_model(ModelConfig(model_path=path), attn_implementation=packed_attn_implementation()).train()

    eager, compiled = load(), load()
    torch._dynamo.reset()
    counters.clear()
    compile_decoder_layers(compiled, KEY)
    batches = batches or [make_batch(b=b, p=12, r=r, seed=i, vocab=250) for i, (b, r) in enumerate(LENGTHS)]
    graphs = []
    for mb in batches:
        ref_lp, ref_grads = _log_probs_and_grads(eager, mb, ForwardOptions(padding_free=True))
        lp, grads = _log_probs_and_grads(compiled, mb, ForwardOptions(padding_free=True))
        mask = mb["response_mask"].bool()
        torch.testing.assert_close(lp[mask], ref_lp[mask], atol=1e-5, rtol=1e-4)
        assert grads.keys() == ref_grads.keys() and grads
        for key, ref in ref_grads.items():
            torch.testing.assert_close(grads[key], ref, atol=1e-5, rtol=1e-4, msg=key)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] >= 1 and graphs == [graphs[0]] * len(batches), graphs


def test_a_linear_attention_model_compiles_around_its_recurrence(tmp_path: Path) -> None:
    """Qwen3.5 (Gated DeltaNet and full-attention layers, packed samples kept apart): its token mixers stay eager,
    the rest of each layer compiles (7 s here; traced whole it did not finish in 7 minutes), the eager log-probs and
    gradients, the linear layers' own parameters included, and no recompile."""
    _compiled_against_eager(_tiny("qwen3_5", tmp_path))


@pytest.mark.gpu
def test_compiled_layers_on_cuda_within_bf16() -> None:
    """bf16 on CUDA (inductor's Triton kernels), packed with the GPU's varlen attention: the eager log-probs within
    bf16 rounding (0.05 on log-probs, as the Liger test allows), no recompile over the three lengths."""
    eager = tiny_lm().to("cuda", torch.bfloat16).train()
    eager.config._attn_implementation = packed_attn_implementation()
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    counters.clear()
    compile_decoder_layers(compiled, KEY)
    opts = ForwardOptions(padding_free=True)
    graphs = []
    for i, (b, r) in enumerate(LENGTHS):
        mb = make_batch(b=b, p=12, r=r, seed=i)
        ref_lp, ref_grads = _log_probs_and_grads(eager, mb, opts, "cuda")
        lp, grads = _log_probs_and_grads(compiled, mb, opts, "cuda")
        mask = mb["response_mask"].bool().cuda()
        assert (lp[mask] - ref_lp[mask]).abs().max().item() < 0.05
        for name, ref in ref_grads.items():
            assert torch.allclose(grads[name], ref, rtol=0.05, atol=1e-2 * ref.abs().max().item()), name
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [graphs[0]] * len(LENGTHS), graphs


@pytest.mark.extended
def test_one_training_step_with_compiled_layers(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]
) -> None:
    """`easyrl train` with the switch on, the default padding-free layout and gradient checkpointing, FSDP2 over two
    CPU workers: the step trains (finite loss, every weight moved) and the weights keep their names."""
    from easyrl.distributed import init_ray

    started = init_ray(num_cpus=4)  # False: a Ray of an earlier test module is up and serves this run
    edits = {
        KEY: True,
        "worker.actor.padding_free": True,
        "worker.actor.model.enable_gradient_checkpointing": True,
    }
    try:
        rows, before, after = train_steps(tmp_path, tiny_model_dir, digits_data, edits, steps=1, weights=True)
    finally:
        if started:
            import ray

            ray.shutdown()
    assert before is not None and after is not None and before.keys() == after.keys()
    assert not any("_orig_mod" in name for name in after)
    assert all(not torch.equal(before[n], after[n]) for n in after), "every trained weight moves"
    assert torch.isfinite(torch.tensor(rows[-1]["actor/pg_loss"]))


@pytest.mark.extended
@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "qwen3_5_moe", "qwen2_5_vl"])
def test_other_families_compile_without_recompiles(name: str, tmp_path: Path) -> None:
    """A dense Llama, the routed experts of Qwen3 MoE and Qwen3.5 MoE (linear attention too) and Qwen2.5-VL's
    language layers (images and a video through the eager vision tower first, then text rows), packed: the eager
    log-probs and gradients within fp32 tolerance, no recompile after the first micro-batch. Extended: an MoE's
    compile alone takes ~25-70 s on this CPU."""
    path, batches = _tiny(name, tmp_path), None
    if name == "qwen2_5_vl":
        from easyrl.models import load_processor
        from tests.workers.test_packing_vl import _batch, _write_video

        _write_video(tmp_path / "clip.mp4")
        batches = [make_batch(b=b, p=12, r=r, seed=i, vocab=250) for i, (b, r) in enumerate(LENGTHS)]
        batches[0] = _batch(load_processor(path), tmp_path / "clip.mp4")
    _compiled_against_eager(path, batches)
