"""The family table (`easyrl.models.family`): every family has a tiny model that builds as that `model_type`, every
family the GPU recipe matrix trains is in the table, and a `model_type` outside it is one line naming the table."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from easyrl.models.family import FAMILIES, NOT_TRAINED, UnknownFamilyError, family_of


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_has_a_tiny_model_of_its_type(model_type: str, tmp_path: Path) -> None:
    from easyrl.models import load_processor, vision_spec
    from easyrl.testing.families import build_tiny_family

    family = FAMILIES[model_type]
    path = build_tiny_family(tmp_path / model_type, model_type)
    assert json.loads((Path(path) / "config.json").read_text())["model_type"] == model_type
    processor = load_processor(path)
    if family.media is None:
        assert processor is None, f"{model_type}: a text family saved a processor"
    else:  # the media arithmetic the profile names is the one its processor gets
        assert vision_spec(processor).media == family.media


def test_every_family_the_recipe_matrix_trains_is_in_the_table() -> None:
    """tests/recipes/families.py trains each family's tiny model on a GPU: each names an architecture of the table."""
    from tests.recipes.families import FAMILIES as RECIPES

    known = {value for profile in FAMILIES.values() for _, value in profile.tiny.kwargs}
    trained = {}
    for recipe in RECIPES:
        assert isinstance(recipe.run, partial), recipe.name
        trained[recipe.name] = recipe.run.keywords.get("arch") or recipe.run.keywords["variant"]
    unknown = {name: arch for name, arch in trained.items() if arch not in known}
    assert not unknown, f"recipes train families without a profile: {unknown}"


def test_each_refused_capability_is_asked_for_by_a_config_key_and_each_key_refuses_some_family() -> None:
    """A profile's `refuses` works only through `_REFUSED_KEYS` (the key that asks for the capability); a key no
    profile refuses any more is a lifted refusal left behind."""
    from easyrl.config.validate import _REFUSED_KEYS

    refused = {capability for profile in FAMILIES.values() for capability, _ in profile.refuses}
    asked = {capability for capability, _, _ in _REFUSED_KEYS}
    assert refused == asked, (
        f"refused by a profile but asked by no key: {refused - asked}; keys left: {asked - refused}"
    )


def test_an_unlisted_model_type_trains_as_a_dense_text_decoder_and_the_whole_omni_models_are_refused() -> None:
    profile = family_of("mistral")
    assert profile.model_type == "mistral" and profile.media is None and not profile.thinker and profile.tiny is None
    assert profile.logits_to_keep and profile.refusal("vllm") is None
    for model_type, why in NOT_TRAINED.items():  # the whole Omni models: what to train instead
        with pytest.raises(UnknownFamilyError) as info:
            family_of(model_type)
        assert why in str(info.value) and "save the thinker alone" in why


def test_a_config_whose_model_has_no_profile_loads_and_its_run_warns_once_naming_the_table(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]
) -> None:
    import shutil

    from easyrl.check import start_lines
    from easyrl.config import load_config
    from tests.conftest import base_config, write_config

    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    run = base_config(str(model), digits_data, tmp_path / "run")
    assert not [w for w in start_lines(load_config(write_config(tmp_path / "a.yaml", run)), "rl")[1] if "family" in w]
    (model / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    cfg = load_config(write_config(tmp_path / "cfg.yaml", run))
    found = [w for w in start_lines(cfg, "rl")[1] if "family profile" in w]
    assert len(found) == 1 and "'mistral'" in found[0] and "easyrl/models/family.py" in found[0], found
    assert "\n" not in found[0]


def test_family_of_reads_a_model_a_config_or_a_name() -> None:
    from transformers import Qwen3Config

    config = Qwen3Config(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    assert family_of(config) is family_of("qwen3") is FAMILIES["qwen3"]
    assert family_of(type("Wrapped", (), {"config": config})()) is FAMILIES["qwen3"]
