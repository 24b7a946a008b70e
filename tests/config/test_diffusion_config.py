"""`easyrl.config.diffusion`: detecting a diffusers pipeline, validating its keys and translating Long-RL's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from easyrl.config.diffusion import is_diffusion_pipeline


def test_a_folder_is_a_pipeline_only_with_a_model_index(tmp_path: Path) -> None:
    assert not is_diffusion_pipeline(str(tmp_path)) and not is_diffusion_pipeline(None)
    (tmp_path / "config.json").write_text("{}")
    assert not is_diffusion_pipeline(str(tmp_path))
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    assert is_diffusion_pipeline(str(tmp_path))


def test_a_hub_id_is_read_from_the_local_cache_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A cache laid out as huggingface_hub lays it out: refs/main names the snapshot that holds the files.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "models--org--pipe"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc")
    (repo / "snapshots" / "abc").mkdir(parents=True)
    assert not is_diffusion_pipeline("org/pipe")
    (repo / "snapshots" / "abc" / "model_index.json").write_text("{}")
    assert is_diffusion_pipeline("org/pipe")
    assert not is_diffusion_pipeline("org/not-cached-anywhere")


def _diffusion_setup(tmp_path: Path) -> tuple[str, Path]:
    from easyrl.diffusion.tiny import build_tiny_sd3_pipeline

    pipe = str(build_tiny_sd3_pipeline(tmp_path / "sd3", seed=0))
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a red square", "answer": "red"}\n' * 4)
    return pipe, data


def _load(tmp_path: Path, yaml_text: str, overrides: list[str] = (), notes: list[str] | None = None):  # type: ignore[assignment]
    from easyrl.config import load_config
    from tests.conftest import REPO

    pipe, data = _diffusion_setup(tmp_path)
    path = tmp_path / "config.yaml"
    path.write_text(yaml_text)
    base = [
        f"worker.actor.model.model_path={pipe}",
        f"data.train_files={data}",
        f"data.val_files={data}",
        f"worker.reward.reward_function={REPO / 'reward_functions' / 'image_colour.py'}:compute_score",
        "data.rollout_batch_size=2",
        "worker.actor.global_batch_size=2",
        "worker.rollout.n=2",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
    ]
    return load_config(path, [*base, *overrides], notes)


LONGRL = """
data: {diffusion: true}
algorithm: {kl_penalty: flow_grpo}
worker:
  actor: {diffusion: true, guidance_scale: 2.0, kl_penalty: flow_grpo, scheduler: some/pipe}
  ref: {diffusion: true, guidance_scale: 2.0, scheduler: some/pipe, ulysses_size: 1}
  rollout: {diffusion: true, guidance_scale: 2.0, resolution: 64, num_steps: 3, kl_reward: 0.0}
  reward: {diffusion: true}
trainer: {diffusion: true}
"""


def test_long_rl_diffusion_keys_are_translated_with_a_note(tmp_path: Path) -> None:
    notes: list[str] = []
    cfg = _load(tmp_path, LONGRL, notes=notes)
    diff = cfg.worker.rollout.diffusion
    assert (diff.enable, diff.guidance_scale, diff.num_steps, diff.height, diff.width) == (True, 2.0, 3, 64, 64)
    assert cfg.algorithm.kl_penalty == "kl"  # the diffusion KL is the closed-form Gaussian one
    assert any("worker.rollout.resolution is Long-RL's name for" in n for n in notes), notes
    assert any("trainer.diffusion" in n and "enable=True" in n for n in notes), notes


def test_long_rl_video_configs_keep_height_and_width_over_resolution(tmp_path: Path) -> None:
    # Long-RL's video config sets height/width for its sampler and leaves `resolution` (the image key) at 768
    notes: list[str] = []
    cfg = _load(tmp_path, "worker: {rollout: {diffusion: true, resolution: 768, height: 32, width: 40}}", notes=notes)
    assert (cfg.worker.rollout.diffusion.height, cfg.worker.rollout.diffusion.width) == (32, 40)
    assert any("worker.rollout.resolution is Long-RL's image size" in n for n in notes), notes


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("worker: {rollout: {kl_reward: 0.1}}", "worker.rollout.kl_reward: Long-RL's KL-as-reward"),
        ("worker: {rollout: {guidance_scale: 2.0}, actor: {guidance_scale: 3.0}}", "set to another value"),
        ("trainer: {diffusion: true}\nworker: {rollout: {diffusion: {enable: false}}}", "say otherwise"),
    ],
)
def test_long_rl_keys_without_an_equivalent_are_refused_by_name(tmp_path: Path, yaml_text: str, message: str) -> None:
    from easyrl.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, yaml_text)


def test_a_pipeline_folder_is_detected_and_needs_no_llm_config(tmp_path: Path) -> None:
    cfg = _load(tmp_path, "worker: {rollout: {diffusion: {height: 32, width: 32}}}")
    from easyrl.config.diffusion import diffusion_enabled

    assert cfg.worker.rollout.diffusion.enable is None
    assert diffusion_enabled(cfg.worker.rollout.diffusion.enable, cfg.worker.actor.model.model_path)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("worker.rollout.diffusion.height=36", "height: 36 is not a multiple of 8 .*VAE scale 4 x patch 2.*use 32"),
        ("worker.rollout.diffusion.num_frames=5", "num_frames: StableDiffusion3Pipeline makes images: set it to 1"),
        ("worker.rollout.diffusion.train_timestep_fraction=0", r"train_timestep_fraction: must be in \(0, 1\]"),
        ("worker.rollout.diffusion.noise_level=0", "noise_level: must be > 0"),
        ("worker.rollout.diffusion.num_steps=0", "num_steps: must be at least 1"),
        ("worker.rollout.diffusion.guidance_scale=0.5", "guidance_scale: must be >= 1"),
    ],
)
def test_bad_diffusion_values_fail_with_one_line(tmp_path: Path, override: str, message: str) -> None:
    from easyrl.config import ConfigError

    with pytest.raises(ConfigError, match=f"worker.rollout.diffusion.{message}"):
        _load(tmp_path, "{}", ["worker.rollout.diffusion.height=32", "worker.rollout.diffusion.width=32", override])


def test_enable_without_a_pipeline_names_the_model_path(tmp_path: Path) -> None:
    from easyrl.config.diffusion import DiffusionConfig, check_diffusion
    from easyrl.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"enable: is true but worker.actor.model.model_path .* no model_index.json"):
        check_diffusion(DiffusionConfig(enable=True), str(tmp_path))
    check_diffusion(DiffusionConfig(enable=False, noise_level=0), str(tmp_path))  # not a diffusion run: unchecked


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "trainer.max_staleness=1",
            "trainer.max_staleness: 1, but the diffusers engine samples every trajectory whole with one policy: "
            "diffusion runs are synchronous, set it to 0",
        ),
        (
            "worker.rollout.multi_turn.env=env.py:Env",
            "worker.rollout.multi_turn: an environment or tools are set, but the diffusers engine samples images, "
            "which have no turns: remove them",
        ),
    ],
)
def test_what_an_image_engine_cannot_do_is_refused_in_one_line(tmp_path: Path, override: str, line: str) -> None:
    from easyrl.config import ConfigError

    with pytest.raises(ConfigError) as err:
        _load(tmp_path, "{}\n", [override])
    assert str(err.value) == line


def test_a_pipelines_prompts_are_its_plain_text_tokenized_by_its_own_tokenizer(tmp_path: Path) -> None:
    from easyrl.config import ConfigError
    from easyrl.trainer.worker_groups import build_data

    cfg = _load(tmp_path, "{}\n")
    assert cfg.worker.actor.model.tokenizer_path == f"{cfg.worker.actor.model.model_path}/tokenizer"
    # the default engine (vllm) becomes diffusers; an explicit other text engine is refused (tests/config)
    assert _load(tmp_path, "{}\n", ["worker.rollout.name=vllm"]).worker.rollout.name == "diffusers"
    with pytest.raises(ConfigError, match=r"worker\.rollout\.name: hf, but the hf engine samples text"):
        _load(tmp_path, "{}\n", ["worker.rollout.name=hf"])
    tokenizer, train, _, _ = build_data(cfg)
    row = train[0]
    assert row["raw_prompt"] == "a red square" and type(tokenizer).__name__.startswith("CLIPTokenizer")
    assert tokenizer.decode(row["prompt_ids"]).replace(" ", "").startswith("aredsquare")
