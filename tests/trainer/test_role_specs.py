"""Workers are built from their spec alone: the driver resolves the config into one frozen spec per role, and a
worker given only that spec (pickled, as Ray sends it) loads, generates, scores and trains."""

from __future__ import annotations

import dataclasses
import pickle
import socket
from pathlib import Path

import pytest
import torch

from easyrl.batch import Batch
from easyrl.config import EasyRLConfig, load_config
from easyrl.rollout import WeightSync
from easyrl.seeding import SEED_COLUMN, prompt_seeds
from easyrl.trainer.plan import old_log_prob_pass, plan_of
from easyrl.trainer.role_specs import build_role_specs, sampling_params
from easyrl.trainer.step_math import OldPass
from tests.conftest import base_config, left_padded_prompts, write_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(tmp_path: Path, model_dir: str, data: dict[str, str], **algorithm: object) -> EasyRLConfig:
    raw = base_config(model_dir, data, tmp_path / "ckpt")
    raw["algorithm"] = {"adv_estimator": "gae", "disable_kl": False, "use_kl_loss": True, **algorithm}
    raw["trainer"]["n_gpus_per_node"] = 1
    raw["worker"]["critic"] = {"global_batch_size": 2, "micro_batch_size_per_device_for_update": 2}
    return load_config(write_config(tmp_path / "cfg.yaml", raw), [])


USER_ESTIMATORS = """
from easyrl.algorithms import EstimatorNeeds, get_advantage_estimator, register_advantage_estimator


@register_advantage_estimator("spec_test_user_gae", needs=EstimatorNeeds(needs_critic=True))
def user_gae(**kwargs):
    return get_advantage_estimator("gae")(**kwargs)


@register_advantage_estimator("spec_test_user_plain")
def user_plain(**kwargs):
    return get_advantage_estimator("reinforce_plus_plus")(**kwargs)


@register_advantage_estimator("spec_test_user_grouped", needs=EstimatorNeeds(grouped=True))
def user_grouped(**kwargs):
    return get_advantage_estimator("grpo")(**kwargs)
"""


def test_a_user_estimator_declaring_needs_critic_gets_a_critic(tmp_path, tiny_model_dir, digits_data) -> None:
    module = tmp_path / "user_estimators.py"
    module.write_text(USER_ESTIMATORS)
    users = [str(module)]
    with_critic = _config(
        tmp_path, tiny_model_dir, digits_data, adv_estimator="spec_test_user_gae", user_modules=users
    )
    specs = build_role_specs(with_critic, plan_of(with_critic), optimizer_steps=4, world_size=1)
    assert specs.critic is not None and specs.critic.model.kind == "value"
    plain = _config(tmp_path, tiny_model_dir, digits_data, adv_estimator="spec_test_user_plain", user_modules=users)
    assert build_role_specs(plain, plan_of(plain), optimizer_steps=4, world_size=1).critic is None
    # the validator reads the same declarations: a grouped user estimator needs n >= 2
    from easyrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"worker\.rollout\.n: spec_test_user_grouped compares"):
        raw = base_config(tiny_model_dir, digits_data, tmp_path / "ckpt")
        raw["algorithm"] = {"adv_estimator": "spec_test_user_grouped", "user_modules": users}
        raw["worker"]["rollout"]["n"] = 1
        load_config(write_config(tmp_path / "grouped.yaml", raw), [])


USER_LOSS = """
from dataclasses import dataclass

import torch

from easyrl.algorithms import register_policy_loss


@dataclass(frozen=True)
class GateParams:
    tau_negative: float
    clip_ratio_low: float


@register_policy_loss("spec_test_user_gate", params=GateParams)
def user_gate(old_log_prob, log_prob, advantages, response_mask, *, params, loss_agg_mode, rollout_is_weights):
    assert type(params).__name__ == "GateParams"
    loss = -(advantages * log_prob * response_mask).sum() * params.clip_ratio_low
    return loss, {"tau_negative": torch.tensor(params.tau_negative), "clip_ratio_low": params.clip_ratio_low}
"""

UNFILLABLE_LOSS = """
from dataclasses import dataclass

from easyrl.algorithms import register_policy_loss


@dataclass(frozen=True)
class TypoParams:
    clip_ratio_hi: float


@register_policy_loss("spec_test_typo", params=TypoParams)
def typo(**kwargs):
    raise AssertionError("never registered")
"""


def test_a_user_loss_gets_its_own_params_from_the_config(tmp_path, tiny_model_dir, digits_data) -> None:
    import subprocess
    import sys

    from easyrl.workers.actor import policy_objective

    module = tmp_path / "user_loss.py"
    module.write_text(USER_LOSS)
    raw = base_config(tiny_model_dir, digits_data, tmp_path / "ckpt")
    raw["algorithm"]["user_modules"] = [str(module)]
    raw["worker"]["actor"].update(loss_type="spec_test_user_gate", tau_negative=2.5, clip_ratio_low=0.1)
    cfg = load_config(write_config(tmp_path / "cfg.yaml", raw), [])
    loss = build_role_specs(cfg, plan_of(cfg), 4, 1).actor.loss
    assert loss.params == (("tau_negative", 2.5), ("clip_ratio_low", 0.1))  # its own knobs, none of ppo's
    # Ray unpickles a spec before the worker imports `user_modules`: the spec must not name the user's class
    sent = pickle.dumps(loss)
    subprocess.run(
        [sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"], input=sent, check=True
    )
    ones = torch.ones(1, 3)
    mb = Batch({"loss_mask": ones, "advantages": ones, "old_log_probs": -ones})
    out = policy_objective(mb, -ones.requires_grad_(True), None, pickle.loads(sent), "token-mean", 0.0)
    assert out.loss.item() == pytest.approx(0.3)  # -(1 * -1 * 3) * 0.1
    assert {k: float(v) for k, v in out.token_means.items()} == {
        "actor/tau_negative": 2.5,
        "actor/clip_ratio_low": 0.1,
    }


def test_a_user_loss_params_field_the_config_cannot_fill_is_one_config_error(
    tmp_path, tiny_model_dir, digits_data
) -> None:
    from easyrl.config import ConfigError

    module = tmp_path / "typo_loss.py"
    module.write_text(UNFILLABLE_LOSS)
    raw = base_config(tiny_model_dir, digits_data, tmp_path / "ckpt")
    raw["algorithm"]["user_modules"] = [str(module)]
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path / "cfg.yaml", raw), [])
    message = str(info.value)
    assert message.startswith("algorithm.user_modules[0]: importing") and "\n" not in message
    assert "'spec_test_typo'" in message and "'clip_ratio_hi'" in message and "worker.actor key" in message


def test_kl_mode_is_derived_once() -> None:
    from easyrl.config.algorithm import AlgorithmConfig, KLMode

    assert AlgorithmConfig(disable_kl=True, use_kl_loss=True).kl_mode == KLMode.OFF
    assert AlgorithmConfig(use_kl_loss=True).kl_mode == KLMode.IN_LOSS
    assert AlgorithmConfig().kl_mode == KLMode.IN_REWARD


def _reaches_config(obj: object) -> bool:
    """Whether `obj` holds an `EasyRLConfig` anywhere in its dataclass fields."""
    if isinstance(obj, EasyRLConfig):
        return True
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return any(_reaches_config(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return False


@pytest.fixture
def single_process(monkeypatch: pytest.MonkeyPatch):
    """This process as a world of one worker (the env Ray's worker group would set)."""
    import torch.distributed as dist

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    # An in-process vLLM engine of an earlier test may own the default group (vLLM keeps its world group in a
    # global): destroying that one would break the next engine of this process. Only the group this test made goes.
    ours = not dist.is_initialized()
    yield
    if ours and dist.is_initialized():
        dist.destroy_process_group()


def test_specs_carry_no_config_and_do_the_batch_arithmetic(tmp_path, tiny_model_dir, digits_data) -> None:
    cfg = _config(tmp_path, tiny_model_dir, digits_data)
    specs = build_role_specs(cfg, plan_of(cfg), optimizer_steps=4, world_size=2)
    assert specs.ref is not None and specs.critic is not None
    for spec in (specs.actor, specs.ref, specs.critic):
        assert not _reaches_config(spec)
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.process = spec.process  # type: ignore[misc]
    # global_batch_size 2 * n 2 over 2 workers: 2 samples per optimizer step on each rank
    assert specs.actor.update.mini_batch_size == 2 and specs.critic.update.mini_batch_size == 2
    assert specs.actor.loss.kl_in_loss and specs.critic.model.kind == "value"
    assert specs.ref.model.optim is None and specs.ref.model.model.model_path == tiny_model_dir


def test_workers_built_from_their_spec_alone(tmp_path, tiny_model_dir, digits_data, single_process) -> None:
    from easyrl.workers.actor import ActorWorker
    from easyrl.workers.critic import CriticWorker
    from easyrl.workers.ref import RefWorker

    cfg = _config(tmp_path, tiny_model_dir, digits_data)
    specs = build_role_specs(cfg, plan_of(cfg), optimizer_steps=4, world_size=1)
    sampling = sampling_params(cfg, plan_of(cfg)).override({"seed": 5})
    sent = pickle.dumps(specs)  # what crosses to the worker processes
    del cfg, specs
    specs = pickle.loads(sent)

    actor = ActorWorker(specs.actor)
    actor.init_model()
    prompts = left_padded_prompts(tiny_model_dir, ["Copy: 1 2 3", "Copy: 0 3"])
    # the driver seeds every prompt before the batch is split (Trainer.generate); the worker refuses unseeded ones
    prompts = prompts.set(**{SEED_COLUMN: prompt_seeds(sampling.seed, len(prompts), sampling.n)})
    out, timing = actor.generate_sequences(prompts, sampling)
    assert {"timing_s/wake", "timing_s/generate_engine", "timing_s/sleep"} <= set(timing)
    assert out["responses"].shape == (2 * sampling.n, sampling.max_tokens)  # the engine returned B*n rows
    assert out["policy_version"].dtype == torch.int64 and out["policy_version"].tolist() == [0] * len(out)
    assert torch.equal(out["prompts"], prompts["input_ids"].repeat_interleave(sampling.n, 0))
    batch = out.union(actor.compute_log_probs(out))

    ref = RefWorker(specs.ref)
    ref.init_model()
    batch = batch.union(ref.compute_ref_log_probs(batch))
    mask = batch["response_mask"].bool()
    assert torch.allclose(batch["ref_log_probs"][mask], batch["old_log_probs"][mask], atol=1e-5)  # same weights

    critic = CriticWorker(specs.critic)
    critic.init_model()
    batch = batch.union(critic.compute_values(batch))
    assert batch["values"].shape == batch["responses"].shape

    advantages = torch.linspace(-1, 1, len(batch))[:, None].expand_as(mask).float() * mask
    batch.set(advantages=advantages, returns=advantages)
    before = {k: v.detach().clone() for k, v in actor.full_weights().items()}
    metrics = actor.update_actor(batch, entropy_coeff=0.0)
    assert "actor/pg_loss" in metrics and "actor/kl_loss" in metrics and metrics["actor/skipped_updates"] == 0
    after = actor.full_weights()
    assert any(not torch.equal(before[k], after[k]) for k in before), "the update changed no weight"
    # the next rollout pushes the updated weights: every row says it was sampled by policy version 1
    assert actor.generate_sequences(prompts, sampling)[0]["policy_version"].tolist() == [1] * len(out)
    assert "critic/vf_loss" in critic.update_critic(batch)


def test_an_engine_session_generates_the_rows_of_generate_sequences(
    tmp_path, tiny_model_dir, digits_data, single_process
) -> None:
    """open_rollout -> generate twice -> close_rollout on the HF engine: each generate gives the very rows that a
    whole `generate_sequences` call gives (one wake and one push serve both), and no lifecycle runs inside."""
    from easyrl.workers.actor import ActorWorker

    cfg = _config(tmp_path, tiny_model_dir, digits_data)
    actor = ActorWorker(build_role_specs(cfg, plan_of(cfg), optimizer_steps=4, world_size=1).actor)
    actor.init_model()
    sampling = sampling_params(cfg, plan_of(cfg)).override({"seed": 7})
    first = left_padded_prompts(tiny_model_dir, ["Copy: 1 2 3", "Copy: 0 3"])
    second = left_padded_prompts(tiny_model_dir, ["Copy: 2", "Copy: 3 1 0 2"])
    for prompts in (first, second):
        prompts.set(**{SEED_COLUMN: prompt_seeds(sampling.seed, len(prompts), sampling.n)})
    with pytest.raises(RuntimeError, match="call open_rollout first"):
        actor.generate(first, sampling)
    timing = actor.open_rollout()
    assert "timing_s/wake" in timing
    rows = [actor.generate(first, sampling), actor.generate(second, sampling)]
    assert "timing_s/sleep" in actor.close_rollout()
    for prompts, got in zip((first, second), rows):
        whole, _ = actor.generate_sequences(prompts, sampling)
        assert set(got.tensors) == set(whole.tensors)
        for key, value in whole.tensors.items():
            assert torch.equal(got[key], value), key


@pytest.mark.parametrize(
    ("overrides", "sync", "level"),
    [
        ([], WeightSync.FULL, 2),
        (["worker.actor.model.lora.rank=8"], WeightSync.MERGED_LORA, 2),
        (
            ["worker.actor.model.lora.rank=8", "worker.actor.model.lora.rollout_sync=adapter"],
            WeightSync.ADAPTER,
            1,
        ),
    ],
)
def test_the_actor_spec_carries_how_weights_reach_the_engine(
    overrides: list[str], sync: WeightSync, level: int
) -> None:
    """The driver resolves the WeightSync from the LoRA settings; the sleep level follows from it."""
    cfg = load_config(DEMO, ["worker.rollout.name=vllm", *overrides])
    rollout = build_role_specs(cfg, plan_of(cfg), optimizer_steps=4, world_size=2).actor.rollout
    assert rollout.weight_sync is sync and rollout.sleep_level == level


def test_sleep_level_is_derived_from_how_weights_reach_the_engine() -> None:
    """Null sleep_level: 2 when every step sends the full weights (plain or merged LoRA), 1 for adapter sync (the
    engine keeps its base weights); an explicit level wins."""
    from omegaconf import OmegaConf

    from easyrl.trainer.plan import effective_sleep_level

    def level(**overrides: object) -> int:
        raw = OmegaConf.merge(
            OmegaConf.structured(EasyRLConfig), OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()])
        )
        return effective_sleep_level(OmegaConf.to_object(raw))  # type: ignore[arg-type]

    assert level() == 2
    assert level(**{"worker.actor.model.lora.rank": 8}) == 2  # merged sync sends every weight each step
    assert level(**{"worker.actor.model.lora.rank": 8, "worker.actor.model.lora.rollout_sync": "adapter"}) == 1
    assert level(**{"worker.rollout.sleep_level": 1}) == 1


DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


@pytest.mark.parametrize(
    ("overrides", "packed"),
    [
        (["trainer.device=cpu"], False),  # auto on CPU: padded (per-sequence attention is slower there)
        (["trainer.device=cuda"], True),  # auto on GPUs: packed varlen
        (["trainer.device=cpu", "trainer.n_gpus_per_node=2", "worker.actor.ulysses_size=2"], True),  # SP: packed rows
        (["trainer.device=cpu", "worker.actor.padding_free=true"], True),  # explicit values are kept
        (["trainer.device=cuda", "worker.actor.padding_free=false"], False),
    ],
)
def test_padding_free_null_picks_the_layout_per_device_for_every_role(overrides: list[str], packed: bool) -> None:
    gae = ["algorithm.adv_estimator=gae", "algorithm.disable_kl=false", "worker.critic.global_batch_size=16"]
    cfg = load_config(DEMO, [*overrides, *gae])
    specs = build_role_specs(cfg, plan_of(cfg), optimizer_steps=4, world_size=2)
    assert specs.ref is not None and specs.critic is not None
    layouts = {specs.actor.model.forward.padding_free, specs.ref.model.forward.padding_free}
    assert layouts | {specs.critic.model.forward.padding_free} == {packed}


def test_engine_log_probs_are_asked_for_whenever_the_sample_ratio_is_above_zero() -> None:
    """The engine-vs-actor figures (`rollout/token_prob_error`) are measured with the old-log-prob pass or, without
    it, in the update's own forward: the engines report log-probs whenever a share of the prompts gets them (1 in
    8 by default), pass or no pass, and none at `logprob_sample_ratio: 0`; the figures force no pass."""
    demo = load_config(DEMO, [])  # 1 epoch over 1 mini-batch: the pass is skipped
    assert old_log_prob_pass(demo) is OldPass.NONE and sampling_params(demo, plan_of(demo)).logprobs is True
    two = load_config(DEMO, ["worker.actor.ppo_epochs=2"])
    assert sampling_params(two, plan_of(two)).logprobs is True
    explicit = load_config(DEMO, ["worker.rollout.logprob_sample_ratio=0.5"])
    assert sampling_params(explicit, plan_of(explicit)).logprobs is True
    assert old_log_prob_pass(explicit) is OldPass.NONE
    for overrides in ([], ["worker.actor.ppo_epochs=2"]):  # pass or no pass: 0 asks for none
        off = load_config(DEMO, [*overrides, "worker.rollout.logprob_sample_ratio=0"])
        assert sampling_params(off, plan_of(off)).logprobs is False


def test_cpu_workers_share_the_nodes_cores(monkeypatch) -> None:
    """A CPU worker's torch threads: the cores over the workers that run at once on a node (one worker of 2 threads
    on 2 cores, not 1 idle core); the reference takes turns with the actor; separate rollout workers count; the
    environment overrides; every worker's spec carries it."""
    from easyrl.trainer.role_specs import cpu_threads

    monkeypatch.delenv("EASYRL_NUM_THREADS", raising=False)
    cfg = EasyRLConfig()
    cfg.trainer.n_gpus_per_node = 1
    assert cpu_threads(cfg, plan_of(cfg), cores=2) == 2
    cfg.trainer.n_gpus_per_node = 2
    assert cpu_threads(cfg, plan_of(cfg), cores=2) == 1
    assert cpu_threads(cfg, plan_of(cfg), cores=1) == 1  # never 0
    cfg.worker.rollout.placement, cfg.worker.rollout.n_gpus = "separate", 1
    assert cpu_threads(cfg, plan_of(cfg), cores=6) == 2
    # the machine's cores bound Ray's logical CPUs (the tests' private instance has 4 on 2 cores), and the reverse
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(6)))
    cfg.trainer.ray_num_cpus = 9
    assert cpu_threads(cfg, plan_of(cfg)) == 2
    cfg.trainer.ray_num_cpus = 3
    assert cpu_threads(cfg, plan_of(cfg)) == 1
    monkeypatch.setenv("EASYRL_NUM_THREADS", "5")
    assert cpu_threads(cfg, plan_of(cfg), cores=2) == 5
    specs = build_role_specs(cfg, plan_of(cfg), optimizer_steps=1, world_size=2)
    assert specs.actor.process.cpu_threads == 5
