"""Low-rank adapters (LoRA) on the policy: injected with peft before sharding, merged on the fly for the engine.

peft's layers are injected in place (`inject_adapter_in_model`), so the model keeps its Hugging Face class, config
and parameter names, plus `.base_layer` on every adapted linear and its `lora_A` / `lora_B` matrices. Only the
adapters require gradients, so the optimizer (built over trainable parameters) holds their states alone.

The rollout engine never sees peft's names: `merged_weights` yields, for every adapted linear, the full base weight
plus `scale * B @ A` under the base layer's Hugging Face name, one layer at a time (nothing merged stays resident),
and every other parameter unchanged. `adapters_disabled` runs the model as the frozen base: that is the reference
policy of a LoRA run, so no second copy of the base weights is loaded.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from easyrl.config.errors import ConfigError
from easyrl.config.worker import LoraConfig, ModelConfig
from easyrl.workers.model_setup import full_tensor, tied_names


logger = logging.getLogger(__name__)

ADAPTER = "default"
"""peft's adapter name (the only one a run trains)."""
_LORA_PART = re.compile(r"\.lora_(A|B)\.[^.]+\.weight$")


def target_modules(cfg: LoraConfig) -> str | list[str]:
    """`all-linear`, or the comma list as peft's list of module-name suffixes."""
    text = cfg.target_modules.strip()
    if text == "all-linear":
        return text
    return [item.strip() for item in text.split(",") if item.strip()]


def linear_layer_names(model: nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (what `target_modules` may list)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})


def default_exclude(model: nn.Module) -> str | None:
    """What `all-linear` leaves alone unless `exclude_modules` says otherwise: the vision tower of a vision-language
    model (and an Omni thinker's audio tower), and a mixture-of-experts model's routed experts and routers; None when
    nothing is left out.

    Routed experts are fused (experts, out, in) tensors in transformers 5, not linear layers: neither merged into the
    engine's weights nor checkpointed by easyrl's adapter path. The routers stay frozen so that the adapters never move
    which experts a token goes to (the engine and the trainer already disagree on near ties; docs/models.md)."""
    from easyrl.models.vision import audio_tower, vision_tower

    parts = []
    # the media encoders: a VL model's vision tower, an Omni thinker's audio tower beside it
    for tower in (vision_tower(model), audio_tower(model)):
        if tower is not None:
            prefix = next(name for name, m in model.named_modules() if m is tower)
            parts.append(rf"{re.escape(prefix)}(\..*)?")  # the tower and all below it
    if _has_routed_experts(model):
        parts += [r".*\.mlp\.experts(\..*)?", r".*\.mlp\.gate", r".*\.mlp\.shared_expert_gate"]
    # peft full-matches a string exclude_modules as a regex: any one of the parts, whole
    return "|".join(f"(?:{part})" for part in parts) or None


def _has_routed_experts(model: nn.Module) -> bool:
    return any(name.endswith(".experts") for name, _ in model.named_modules())


def _linear_layers_outside(model: nn.Module, exclude: str | None) -> list[str]:
    """The full names of `model`'s linear layers that `exclude` (a full-match regex) leaves, less the output head."""
    get_head: Any = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module is not head and not (exclude and re.fullmatch(exclude, name))
    ]


def apply_lora(
    model: nn.Module, cfg: LoraConfig, key: str = "worker.actor.model.lora", trained_whole: tuple[str, ...] = ()
) -> int:
    """Inject adapters into `model` in place and freeze everything else; returns the trainable parameter count.

    `trained_whole`: top-level modules that get no adapter and train every weight (a critic's new value head, `score`,
    which no checkpoint holds: an adapter on a random head would learn nothing the head could not).

    Raises `ConfigError` (one line naming the model's linear layers) when nothing matches `target_modules`.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    exclude = cfg.exclude_modules if cfg.exclude_modules is not None else default_exclude(model)
    if trained_whole:  # left out of the adapters whatever exclude_modules says
        whole = "|".join(rf"(?:{re.escape(name)}(\..*)?)" for name in trained_whole)
        exclude = whole if exclude is None else f"(?:{exclude})|{whole}"
    targets = target_modules(cfg)
    if targets == "all-linear" and _has_routed_experts(model):
        # peft (0.21, transformers 5) resolves `all-linear` on a MoE model into the fused experts and the router, past
        # exclude_modules: name the linear layers it is to adapt instead
        targets = _linear_layers_outside(model, exclude)
    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        exclude_modules=exclude,
        bias="none",
    )
    model.requires_grad_(False)  # the base stays frozen; the adapters are made trainable below
    try:
        inject_adapter_in_model(peft_cfg, model, adapter_name=ADAPTER)
    except ValueError as exc:
        # peft's ValueErrors for an empty match (peft/tuners/tuners_utils.py); anything else is a real failure
        if "not found in the base model" not in str(exc) and "No modules were targeted" not in str(exc):
            raise
        raise ConfigError(
            f"{key}.target_modules",
            f"{cfg.target_modules!r} (exclude_modules={exclude!r}) matches no linear layer of the model; its "
            f"linear layers are: {', '.join(linear_layer_names(model))}",
        ) from None
    not_linear = sorted(n for n, m in lora_layers(model).items() if not isinstance(m.get_base_layer(), nn.Linear))
    if not_linear:  # embeddings / convolutions keep their adapters elsewhere: neither merged nor checkpointed here
        raise ConfigError(
            f"{key}.target_modules",
            f"{cfg.target_modules!r} adapts layers that are not linear ({', '.join(not_linear[:3])}); name linear "
            f"layers only: {', '.join(linear_layer_names(model))}",
        )
    trainable = adapters = 0
    # Exactly the `lora_A` / `lora_B` weights (and `trained_whole`) train, whatever peft left trainable.
    for name, param in model.named_parameters():
        is_adapter = _LORA_PART.search(name) is not None
        trains = is_adapter or name.split(".", 1)[0] in trained_whole
        param.requires_grad_(trains)
        trainable += param.numel() if trains else 0
        adapters += param.numel() if is_adapter else 0
    if adapters == 0:
        raise ConfigError(
            f"{key}.target_modules",
            f"no adapter was created; the model's linear layers are: {', '.join(linear_layer_names(model))}",
        )
    total = sum(p.numel() for p in model.parameters())
    logger.info(
        "LoRA rank %d: %d trainable of %d parameters (%.2f%%)", cfg.rank, trainable, total, 100 * trainable / total
    )
    return trainable


def check_targets(model_cfg: ModelConfig, key: str = "worker.actor.model.lora") -> None:
    """On the driver, before any worker starts: `apply_lora` on the model built on the meta device (no weights are
    read), so `target_modules` matching nothing stops the run with one line (naming `key`) instead of a worker
    traceback. A critic's model is checked as its causal LM: the same linear layers under another head."""
    from transformers import AutoConfig

    from easyrl.models import model_class_for

    assert model_cfg.model_path is not None
    hf_config = AutoConfig.from_pretrained(model_cfg.model_path, trust_remote_code=model_cfg.trust_remote_code)
    for key, value in model_cfg.override_config.items():
        setattr(hf_config, key, value)
    with torch.device("meta"):
        model = model_class_for(hf_config).from_config(hf_config, trust_remote_code=model_cfg.trust_remote_code)
    apply_lora(model, model_cfg.lora, key)


def lora_layers(model: nn.Module) -> dict[str, Any]:
    """module name -> peft LoRA layer, for every adapted linear of `model`."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_lora(model: nn.Module) -> bool:
    return bool(lora_layers(model))


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run `model` as its frozen base for the block (the reference policy of a LoRA run)."""
    layers = list(lora_layers(model).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)  # also makes the adapters trainable again, as they were


def merged_weights(model: nn.Module, aliases: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of the merged policy, one parameter at a time: W + scale * B @ A for every adapted
    linear (`.base_layer` dropped from its name), every other parameter as it is; the adapters themselves are not
    yielded. Every rank must consume it all (the gathers are collectives). Tied parameters are gathered once, and
    with `aliases` sent again under their other names (`easyrl.workers.model_setup.iter_full_weights`)."""
    layers = lora_layers(model)
    names = tied_names(model) if aliases else {}
    for name, param in model.named_parameters():  # remove_duplicate: tied embeddings once
        if _LORA_PART.search(name):
            continue
        # `x.q_proj.base_layer.weight` -> owner `x.q_proj`, leaf `weight`; a name without `.base_layer.` gets owner ''.
        owner, _, leaf = name.rpartition(".base_layer.")
        layer = layers.get(owner) if leaf else None
        if layer is None:
            full = full_tensor(param)
            yield name, full
            for alias in names.get(name, ()):  # (adapted layers are never tied)
                yield alias, full
            continue
        weight = full_tensor(param)
        if leaf == "weight":  # a base bias goes out unchanged: bias="none" trains none
            a = full_tensor(layer.lora_A[ADAPTER].weight)
            b = full_tensor(layer.lora_B[ADAPTER].weight)
            # peft's merge: W + scaling * (B @ A), scaling = alpha / r (rsLoRA is not enabled)
            weight = weight + (b @ a).to(weight.dtype) * layer.scaling[ADAPTER]
        yield hf_name(name), weight


def hf_name(name: str) -> str:
    """The Hugging Face name of a parameter of an adapted model (`...q_proj.base_layer.weight` -> `...q_proj.weight`)."""
    return name.replace(".base_layer.", ".")


def adapter_description(model: nn.Module, model_cfg: ModelConfig) -> dict[str, Any]:
    """What a LoRA checkpoint records beside its adapters (`lora.json`): enough for `easyrl merge` to rebuild the
    merged model or a PEFT adapter folder."""
    lora = model_cfg.lora
    assert model_cfg.model_path is not None
    return {
        "rank": lora.rank,
        "alpha": lora.alpha,
        "dropout": lora.dropout,
        "modules": sorted(lora_layers(model)),
        "base_model": os.path.abspath(model_cfg.model_path),
    }


def peft_adapter(
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], rank: int, alpha: float, dropout: float, base_model: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, adapter_config) of a PEFT adapter folder from `module -> (A, B)`: the layout
    `peft.PeftModel.from_pretrained` and vLLM's LoRA loader read (`base_model.model.<module>.lora_A.weight`)."""
    tensors: dict[str, torch.Tensor] = {}
    for module, (a, b) in pairs.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(rank),
        "lora_alpha": alpha,
        "lora_dropout": float(dropout),
        # the exact module paths (a full-match regex): a suffix list would also catch same-named vision layers
        "target_modules": "^(?:" + "|".join(re.escape(m) for m in pairs) + ")$",
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
    }
    return tensors, config


def gathered_adapter(model: nn.Module, model_cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The policy's adapters as a PEFT adapter (full tensors, see `peft_adapter`); every rank must call it (the
    gathers are collectives)."""
    pairs = {
        name: (full_tensor(layer.lora_A[ADAPTER].weight), full_tensor(layer.lora_B[ADAPTER].weight))
        for name, layer in lora_layers(model).items()
    }
    lora = model_cfg.lora
    assert model_cfg.model_path is not None
    return peft_adapter(pairs, lora.rank, lora.alpha, lora.dropout, os.path.abspath(model_cfg.model_path))
