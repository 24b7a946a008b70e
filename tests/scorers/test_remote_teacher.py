"""A distillation teacher behind a vLLM server (the CPU build, started and stopped here): its prompt log-probs of the
student's sampled tokens match a local forward pass, and a training run distills through it."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from easyrl.config.model_ref import ModelRefConfig
from tests.conftest import base_config, write_config


pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str):
    from easyrl.testing.vllm_server import VLLMServer

    log = tmp_path_factory.mktemp("teacher_server") / "server.log"
    with VLLMServer(tiny_model_dir, log, name="teacher") as srv:
        yield srv


def test_the_servers_log_probs_of_the_sampled_tokens_are_a_local_forward_pass(server, tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    from easyrl.batch import Batch
    from easyrl.scorers.teacher import RemoteTeacher

    g = torch.Generator().manual_seed(0)
    # two rows as the rollout lays them out: left-padded prompts (4 and 2 tokens), right-padded responses (3 and 1)
    prompts = torch.tensor([[11, 12, 13, 14], [256, 256, 21, 22]])
    responses = torch.tensor([[31, 32, 33], [41, 256, 256]])
    pmask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    rmask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    batch = Batch(
        {
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.cat([pmask, rmask], 1),
            "responses": responses,
            "response_mask": rmask,
            "old_log_probs": torch.randn(2, 3, generator=g),
        }
    )
    got = RemoteTeacher(ModelRefConfig(base_url=server.base_url)).compute_teacher_log_probs(batch)["teacher_log_probs"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    expected = torch.zeros(2, 3)
    for i in range(2):
        seq = batch["input_ids"][i][batch["attention_mask"][i].bool()]
        with torch.no_grad():
            logp = torch.log_softmax(model(seq[None]).logits[0].float(), -1)
        n = int(rmask[i].sum())
        targets = seq[-n:]
        expected[i, :n] = logp[len(seq) - n - 1 : len(seq) - 1].gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)
    assert got[1, 1:].eq(0).all()  # padding stays 0


def test_a_run_distills_through_the_server(server, tmp_path, tiny_model_dir, digits_data) -> None:
    """The served teacher is the student's own checkpoint: at step 1 the two agree on every sampled token (up to
    vLLM's float sums against torch's), and every sample cost one counted request."""
    from easyrl.config import load_config_and_secrets
    from easyrl.distributed import init_ray
    from easyrl.trainer.trainer import Trainer

    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["algorithm"]["distill"] = {"teacher": {"base_url": server.base_url, "tokenizer_path": tiny_model_dir}}
    init_ray(num_cpus=4)
    trainer = Trainer(*load_config_and_secrets(write_config(tmp_path / "cfg.yaml", conf)))
    try:
        trainer.fit()
    finally:
        trainer.close()
        import ray

        ray.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "run" / "experiment_log.jsonl").read_text().splitlines()]
    first = rows[0]
    assert abs(first["distill/reverse_kl"]) < 1e-4 and first["distill/teacher_log_prob"] < -1.0
    # one model lookup at the first step, then one request per sample (4 prompts x 2)
    assert [r["teacher/requests"] for r in rows] == [9.0, 8.0] and all(r["teacher/errors"] == 0 for r in rows)
    assert abs(rows[1]["distill/reverse_kl"]) > 1e-4  # the student moved, the served teacher did not
