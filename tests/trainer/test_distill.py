"""On-policy distillation end to end on CPU: a teacher role on Ray scores the student's sampled tokens, the
advantages take its penalty, and a teacher of another vocabulary is refused before anything starts."""

from __future__ import annotations

import pytest

from tests.conftest import REPO, base_config, write_config
from tests.conftest import train_steps as run


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # Ray: tests/conftest.py


DEMO_MODEL = str(REPO / "assets" / "demo" / "model")


@pytest.fixture(scope="module")
def sharp_teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo's model with its baked-in sampling temperature taken out again (the final norm, which scales the
    tied head's logits, times 3): it knows the digits task as the demo model does, and samples it sharply."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tmp_path_factory.mktemp("teacher") / "sharp")
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL)
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(DEMO_MODEL).save_pretrained(path)
    return path


def distill_edits(teacher: str, **extra: object) -> dict[str, object]:
    return {"algorithm.distill": {"teacher": {"model_path": teacher}, **extra}}


def test_a_teacher_equal_to_the_student_scores_the_sampled_tokens_alike(tmp_path, tiny_model_dir, digits_data) -> None:
    """Step 1: the teacher is the student's own checkpoint, so the log-probs of the sampled tokens agree (a teacher
    reading shifted or other tokens would not); step 2: the student has moved away from it."""
    rows, _, _ = run(tmp_path, tiny_model_dir, digits_data, distill_edits(tiny_model_dir, coef=1.0), steps=2)
    first, second = rows
    assert abs(first["distill/reverse_kl"]) < 1e-6 and abs(first["distill/penalty"]) < 1e-6
    assert first["distill/teacher_log_prob"] < -1.0  # a real log-prob of a random model's samples, not a 0 default
    assert abs(second["distill/reverse_kl"]) > 1e-4
    assert (
        "timing_s/teacher" in first and "timing_s/old" in first
    )  # the old pass runs: its log-probs meet the teacher's


def test_pure_distillation_pulls_the_student_towards_the_teacher(tmp_path, sharp_teacher_dir, digits_data) -> None:
    """Without the task reward (and with one sample per prompt, which grpo alone would refuse), the only signal is
    the teacher's: the demo's soft student sharpens towards it, and its reverse KL to it falls."""
    edits = {
        **distill_edits(sharp_teacher_dir, with_task_reward=False, mode="k1"),
        "worker.rollout.n": 2,
        "data.rollout_batch_size": 8,
        "worker.actor.global_batch_size": 8,
        "worker.actor.micro_batch_size_per_device_for_update": 8,
        "worker.actor.optim": {"lr": 1e-3, "weight_decay": 0.0},
    }
    rows, _, _ = run(tmp_path, DEMO_MODEL, digits_data, edits, steps=8)
    kl = [r["distill/reverse_kl"] for r in rows]
    entropy = [r["actor/entropy_rollout"] for r in rows]
    assert kl[0] > 1.0, kl  # the soft student samples what the sharp teacher would not
    # A one-sample estimate per token, so noisy step to step (2.9, 2.4, 3.4, 2.3, 2.9, 1.6, 2.1, 2.5 when written):
    # compared over three steps at each end.
    assert sum(kl[-3:]) < 0.85 * sum(kl[:3]), kl
    assert entropy[-1] < 0.7 * entropy[0], entropy  # it sharpens, as the teacher is sharper


def test_topk_forward_kl_alone_pulls_the_student_towards_the_teacher(tmp_path, sharp_teacher_dir, digits_data) -> None:
    """`topk_fkl` without the task reward: the advantages are 0, so the only gradient is the forward KL over the
    teacher's top-k tokens, through the student's logits at those ids. It falls, and the student sharpens."""
    edits = {
        **distill_edits(sharp_teacher_dir, with_task_reward=False, mode="topk_fkl", top_k=4),
        "worker.actor.fused_logprobs": False,  # the test config's already; topk_fkl refuses the fused head
        "worker.rollout.n": 2,
        "data.rollout_batch_size": 8,
        "worker.actor.global_batch_size": 8,
        "worker.actor.micro_batch_size_per_device_for_update": 8,
        "worker.actor.optim": {"lr": 1e-3, "weight_decay": 0.0},
    }
    rows, _, _ = run(tmp_path, DEMO_MODEL, digits_data, edits, steps=6)
    fkl = [r["actor/distill_topk_fkl"] for r in rows]
    entropy = [r["actor/entropy_rollout"] for r in rows]
    assert all(r["actor/pg_loss"] == 0.0 and r["distill/penalty"] == 0.0 for r in rows)  # the loss term alone
    assert 0.5 < rows[0]["distill/teacher_topk_mass"] <= 1.0 + 1e-6
    assert fkl[-1] < 0.7 * fkl[0], fkl
    assert entropy[-1] < entropy[0], entropy


def test_a_teacher_with_another_vocabulary_is_refused_before_anything_starts(
    tmp_path, tiny_model_dir, digits_data
) -> None:
    from transformers import AutoTokenizer

    from easyrl.config import ConfigError, load_config
    from easyrl.testing.tiny import build_model
    from easyrl.trainer.worker_groups import build_data

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens(["<tool_call>"])  # one more token: every old id stays, the vocabularies differ
    other = str(tmp_path / "other")
    tokenizer.save_pretrained(other)
    build_model(other, arch="qwen2", num_heads=2, num_kv_heads=1, tokenizer=tokenizer)
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["algorithm"]["distill"] = {"teacher": {"model_path": other}}
    cfg = load_config(write_config(tmp_path / "cfg.yaml", conf))
    with pytest.raises(ConfigError, match=r"algorithm.distill.teacher: the teacher's tokenizer .* only in the second"):
        build_data(cfg)


@pytest.mark.parametrize(
    ("distill", "match"),
    [
        ({"teacher": {"base_url": "http://localhost:8000/v1"}}, "teacher.tokenizer_path: is required with a remote"),
        (
            {"teacher": {"model_path": "MODEL"}, "mode": "fkl"},
            "distill.mode: 'fkl' is not allowed; choose one of: k1, k3, topk_fkl",
        ),
        ({"teacher": {"model_path": "MODEL"}, "coef": -0.1}, "distill.coef: must be >= 0"),
        (
            {"teacher": {"model_path": "MODEL"}, "mode": "topk_fkl", "_fused": True},
            "worker.actor.fused_logprobs: topk_fkl .*set worker.actor.fused_logprobs=false",
        ),
        (
            {"teacher": {"base_url": "http://h/v1", "tokenizer_path": "MODEL"}, "mode": "topk_fkl"},
            "distill.mode: topk_fkl needs the teacher's top-k .* use a local teacher",
        ),
        (
            {"teacher": {"model_path": "MODEL"}, "mode": "topk_fkl", "top_k": 0},
            "distill.top_k: must be >= 1",
        ),
        (
            {"teacher": {"base_url": "http://h/v1", "tokenizer_path": "MODEL"}, "_temperature": 0.7},
            "teacher.base_url: a remote teacher gives log-probs at temperature 1",
        ),
        ({"teacher": {"model_path": "MODEL", "base_url": "http://h/v1"}}, "sets both model_path .* and base_url"),
        ({"teacher": {"model_path": "/nowhere"}}, r"teacher.model_path: no Hugging Face model folder \(config.json\)"),
    ],
    ids=["remote", "mode", "coef", "topk_fused", "topk_remote", "topk_k", "remote_temperature", "both", "missing"],
)
def test_bad_distillation_settings_name_the_key(tmp_path, tiny_model_dir, digits_data, distill, match) -> None:
    import json

    from easyrl.config import ConfigError, load_config

    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["algorithm"]["distill"] = json.loads(json.dumps(distill).replace("MODEL", tiny_model_dir))
    conf["worker"]["rollout"]["temperature"] = conf["algorithm"]["distill"].pop("_temperature", 1.0)
    conf["worker"]["actor"]["fused_logprobs"] = conf["algorithm"]["distill"].pop("_fused", False)
    with pytest.raises(ConfigError, match=match):
        load_config(write_config(tmp_path / "cfg.yaml", conf))


def test_check_prints_the_teacher_in_the_plan(tmp_path, tiny_model_dir, digits_data) -> None:
    from easyrl.check import plan_lines
    from easyrl.config import load_config

    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["algorithm"]["distill"] = {"teacher": {"model_path": tiny_model_dir}, "with_task_reward": False}
    lines = plan_lines(load_config(write_config(tmp_path / "cfg.yaml", conf)))
    assert (
        lines[0].startswith("algorithm: no task advantage")
        and f"distillation from {tiny_model_dir} (k1 x 1.0)" in lines[0]
    )
    assert any(line.startswith("workers:") and "roles: actor+rollout, teacher" in line for line in lines)
