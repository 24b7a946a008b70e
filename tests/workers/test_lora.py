"""LoRA on tiny real models (Qwen2, Qwen3, Qwen2.5-VL), in this process: adapters alone train, the adapters-off
model is the base, the merged stream is base + scale * B @ A under the HF names, and bad LoRA settings stop with
one line. The engines' side (both sync modes) is in test_rollout_engines.py, beside the engines it shares."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from easyrl.config import ConfigError, EasyRLConfig
from easyrl.config.worker import LoraConfig, ModelConfig, OptimConfig
from easyrl.workers.lora import adapters_disabled, apply_lora, hf_name, lora_layers, merged_weights
from easyrl.workers.model_setup import build_optimizer, load_model


def lora_model(model_dir: str, rank: int = 4, seed: int = 0, **kwargs: object) -> nn.Module:
    """The tiny model with adapters whose B is random (peft starts B at zero: the policy would be the base)."""
    torch.manual_seed(seed)
    model = load_model(ModelConfig(model_path=model_dir))
    apply_lora(model, LoraConfig(rank=rank, alpha=2 * rank, **kwargs))  # type: ignore[arg-type]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from easyrl.testing.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), arch="qwen3")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_only_adapters_train_and_adapters_off_is_the_base(arch: str, tiny_model_dir: str, qwen3_dir: str) -> None:
    model_dir = tiny_model_dir if arch == "qwen2" else qwen3_dir
    model = lora_model(model_dir)
    base = load_model(ModelConfig(model_path=model_dir))
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {
        id(p) for p in model.parameters() if p.requires_grad
    }
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(3, 90, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) != (name in trainable), f"{name}: trained {name in trainable}"
    with torch.no_grad(), adapters_disabled(model):
        off = model(input_ids=ids).logits
    with torch.no_grad():
        assert torch.equal(off, base(input_ids=ids).logits), "adapters off is not the base model"
        assert not torch.allclose(model(input_ids=ids).logits, off), "the adapters change nothing"
    assert all(p.requires_grad for n, p in model.named_parameters() if n in trainable), "adapters left frozen"


def test_merged_stream_is_base_plus_scaled_ba(tiny_model_dir: str) -> None:
    model = lora_model(tiny_model_dir)
    base = dict(load_model(ModelConfig(model_path=tiny_model_dir)).named_parameters(remove_duplicate=False))
    merged = dict(merged_weights(model, aliases=True))
    assert set(merged) == set(base), "the stream's names are not the base model's"
    # without aliases the tied head is not gathered a second time
    assert set(dict(merged_weights(model))) == set(base) - {"lm_head.weight"}
    layers = lora_layers(model)
    for name, tensor in merged.items():
        owner = name.rsplit(".", 1)[0]
        if owner in layers and name.endswith(".weight"):
            layer = layers[owner]
            ba = layer.lora_B["default"].weight @ layer.lora_A["default"].weight
            torch.testing.assert_close(tensor, base[name] + ba * layer.scaling["default"], rtol=0, atol=1e-6)
        else:
            assert torch.equal(tensor, base[name]), name
    assert hf_name("model.layers.0.mlp.up_proj.base_layer.weight") == "model.layers.0.mlp.up_proj.weight"


def test_vl_adapters_skip_the_vision_tower_and_merge(tmp_path) -> None:
    from easyrl.models import vision_tower
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint

    vl_dir = build_tiny_vl_checkpoint(tmp_path / "vl")
    model = lora_model(vl_dir)
    visual = vision_tower(model)
    assert visual is not None and not any(".lora_" in n for n, _ in visual.named_parameters())
    assert lora_layers(model), "no language-model layer was adapted"
    base = load_model(ModelConfig(model_path=vl_dir))
    base.load_state_dict(dict(merged_weights(model, aliases=True)), strict=True)
    ids = torch.randint(3, 90, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(base(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_target_modules_matching_nothing_names_the_linear_layers(tiny_model_dir: str) -> None:
    """Checked on the driver (the model on the meta device) before any worker starts, and again where it loads."""
    from easyrl.workers.lora import check_targets

    bad = ModelConfig(model_path=tiny_model_dir, lora=LoraConfig(rank=4, target_modules="qkv"))
    message = r"^worker.actor.model.lora.target_modules: 'qkv'.*are: down_proj, gate_proj, k_proj, lm_head, o_proj"
    with pytest.raises(ConfigError, match=message):
        check_targets(bad)
    with pytest.raises(ConfigError, match=message):
        apply_lora(load_model(bad), bad.lora)
    check_targets(ModelConfig(model_path=tiny_model_dir, lora=LoraConfig(rank=4, target_modules="q_proj, v_proj")))
    embedding = ModelConfig(model_path=tiny_model_dir, lora=LoraConfig(rank=4, target_modules="embed_tokens"))
    with pytest.raises(ConfigError, match=r"target_modules: 'embed_tokens' adapts layers that are not linear"):
        check_targets(embedding)


@pytest.mark.parametrize(
    ("edits", "message"),
    [
        ({"worker.actor.model.lora.rank": -2}, r"^worker.actor.model.lora.rank: must be a positive integer"),
        (
            {
                "worker.critic.model.lora.rank": 8,
                "worker.critic.model.lora.alpha": 0,
                "algorithm.adv_estimator": "gae",
            },
            r"^worker.critic.model.lora.alpha: must be > 0, got 0",
        ),
        (
            {"worker.actor.model.lora.rank": 8, "worker.actor.model.lora.rollout_sync": "adapter"},
            r"^worker.actor.model.lora.rollout_sync: adapter, but the hf engine does not declare LoRA adapters: use "
            r"merged, or worker.rollout.name=vllm",
        ),
        (
            {
                "worker.actor.model.lora.rank": 8,
                "worker.actor.model.lora.rollout_sync": "adapter",
                "worker.rollout.name": "vllm",
                "worker.rollout.sleep_level": 2,
            },
            r"^worker.actor.model.lora.rollout_sync: adapter sends only the adapters .*sleep_level=2 discards",
        ),
    ],
)
def test_bad_lora_settings_stop_with_one_line(edits: dict, message: str) -> None:
    from easyrl.config.engines import check_engine_capabilities
    from easyrl.config.validate import _check_lora

    cfg = EasyRLConfig()
    cfg.worker.rollout.name = "hf"
    for dotted, value in edits.items():
        *parents, leaf = dotted.split(".")
        node: object = cfg
        for part in parents:
            node = getattr(node, part)
        setattr(node, leaf, value)
    with pytest.raises(ConfigError, match=message) as info:
        _check_lora(cfg)
        check_engine_capabilities(cfg)  # what the engine cannot do (adapters on hf) is the engine's record's to say
    assert "\n" not in str(info.value)


def test_a_critic_with_lora_trains_its_adapters_and_its_whole_value_head(tiny_model_dir: str) -> None:
    """The critic (`gae`) with LoRA: adapters on its linear layers but none on its new value head (`score`), which
    trains whole; nothing else requires gradients, and one step moves exactly those."""
    torch.manual_seed(0)
    critic = load_model(ModelConfig(model_path=tiny_model_dir), "value")
    apply_lora(critic, LoraConfig(rank=4, alpha=8), "worker.critic.model.lora", trained_whole=("score",))
    trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert {"score.weight"} <= trainable and all(n.startswith("score.") or ".lora_" in n for n in trainable)
    assert "score" not in lora_layers(critic) and any(n.endswith("q_proj") for n in lora_layers(critic))
    with torch.no_grad():  # peft starts B at zero: move it, so the adapters' own gradients are not all zero
        for name, p in critic.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.3)
    before = {n: p.detach().clone() for n, p in critic.named_parameters()}
    optimizer = build_optimizer(critic, OptimConfig(lr=1e-2))
    critic(input_ids=torch.randint(3, 90, (2, 12))).logits.square().mean().backward()
    optimizer.step()
    for name, p in critic.named_parameters():
        assert torch.equal(p, before[name]) != (name in trainable), f"{name}: trained {name in trainable}"


def test_plan_names_the_adapters_and_the_free_reference() -> None:
    from easyrl.check import plan_lines

    cfg = EasyRLConfig()
    cfg.worker.actor.model.model_path = "m"
    cfg.worker.actor.model.lora.rank = 8
    lines = plan_lines(cfg)
    assert lines[1] == "model: m (LoRA rank 8, alpha 64)"
    workers = next(line for line in lines if line.startswith("workers:"))  # found by name: lines come and go
    assert "roles: actor+rollout, ref (the actor with its adapters off)" in workers
    cfg.algorithm.adv_estimator = "gae"
    cfg.worker.critic.model.lora.rank = 4
    workers = next(line for line in plan_lines(cfg) if line.startswith("workers:"))
    assert "ref (the actor with its adapters off), critic (LoRA rank 4, alpha 64)" in workers
