"""The one forward head (`easyrl.workers.head`): a 4-token probe gives the same log-probs and entropy through every
path (plain, trimmed fused, packed, packed fused, Ulysses split 2 ways on gloo ranks, plain and fused), at
temperature 1 and below, and the entropy as a detached metric alike; training at temperature 0 is refused on every
path with one line naming the key. SFT's top-1 flags (`token_log_probs_and_top1`) mark the model's first choices on
every path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from easyrl.batch import Batch
from easyrl.workers.specs import ForwardOptions
from tests.workers.test_batching import close_rank, init_rank, run_ranks


CPU = torch.device("cpu")
WORLD = 2
PATHS = {
    "plain": ForwardOptions(),
    "fused": ForwardOptions(fused=True, chunk_size=3),
    "packed": ForwardOptions(padding_free=True),
    "packed_fused": ForwardOptions(padding_free=True, fused=True, chunk_size=3),
}
SP_PATHS = {
    "ulysses": ForwardOptions(padding_free=True, ulysses_size=WORLD),
    "ulysses_fused": ForwardOptions(padding_free=True, fused=True, chunk_size=3, ulysses_size=WORLD),
}


def _probe() -> Batch:
    """One row: a 3-token prompt and a 4-token response, no padding."""
    ids = torch.tensor([[5, 17, 42, 8, 61, 23, 9]])
    mask = torch.ones_like(ids)
    return Batch(
        {
            "prompts": ids[:, :3],
            "responses": ids[:, 3:],
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": mask.cumsum(1) - 1,
            "response_mask": mask[:, 3:].clone(),
            "loss_mask": mask[:, 3:].clone(),
        }
    )


def _models(model_dir: str, sp: Any = None) -> dict[str, torch.nn.Module]:
    """The same weights loaded for each attention the paths need: sdpa (padded rows), varlen (packed rows), and,
    given a `SequenceParallel`, the Ulysses attention around varlen."""
    from easyrl.config import ModelConfig
    from easyrl.workers.model_setup import load_model
    from easyrl.workers.varlen import register_varlen_attention

    cfg = ModelConfig(model_path=model_dir)
    models = {"padded": load_model(cfg), "packed": load_model(cfg, attn_implementation=register_varlen_attention())}
    if sp is not None:
        models["split"] = load_model(cfg, attn_implementation=sp.attn_implementation)
        sp.attach(models["split"])
    return models


def _run(models: dict[str, torch.nn.Module], opts: ForwardOptions, temperature: float) -> list[list[float]]:
    from easyrl.workers.forward_backward import token_log_probs

    model = models["split" if opts.ulysses_size > 1 else "packed" if opts.padding_free else "padded"]
    with torch.no_grad():
        lp, ent = token_log_probs(model, _probe(), CPU, temperature, True, opts)
    assert ent is not None
    return [lp[0].tolist(), ent[0].tolist()]


def _run_metric(models: dict[str, torch.nn.Module], opts: ForwardOptions) -> list[Any]:
    """The entropy as the update computes it without a bonus (`entropy_grad=False`, autograd on): its values at
    temperature 0.7 and whether it carries a graph, beside the log-probs' (which must)."""
    from easyrl.workers.forward_backward import token_log_probs

    model = models["split" if opts.ulysses_size > 1 else "packed" if opts.padding_free else "padded"]
    lp, ent = token_log_probs(model, _probe(), CPU, 0.7, True, opts, entropy_grad=False)
    assert ent is not None
    return [ent[0].tolist(), ent.requires_grad, lp.requires_grad]


def _refusal(models: dict[str, torch.nn.Module], opts: ForwardOptions) -> str:
    from easyrl.workers.forward_backward import token_log_probs

    model = models["split" if opts.ulysses_size > 1 else "packed" if opts.padding_free else "padded"]
    try:
        token_log_probs(model, _probe(), CPU, 0.0, True, opts)
    except ValueError as exc:
        return str(exc)
    return "not refused"


def _top1_probe(model: torch.nn.Module) -> Batch:
    """The probe with its response rebuilt token by token: the model's first choice at responses 0 and 2, its second
    at 1 and 3 (so the top-1 flags to find are 1, 0, 1, 0)."""
    ids = _probe()["input_ids"].clone()
    with torch.no_grad():
        for col in range(3, 7):
            ranked = model(input_ids=ids[:, :col]).logits[0, -1].argsort(descending=True)
            ids[0, col] = ranked[0] if col % 2 else ranked[1]
    mask = torch.ones_like(ids)
    fields = {"input_ids": ids, "prompts": ids[:, :3], "responses": ids[:, 3:], "attention_mask": mask}
    return Batch(fields | {"position_ids": mask.cumsum(1) - 1, "response_mask": mask[:, 3:], "loss_mask": mask[:, 3:]})


def _run_top1(models: dict[str, torch.nn.Module], opts: ForwardOptions) -> list[list[float]]:
    from easyrl.workers.head import token_log_probs, token_log_probs_and_top1

    model = models["split" if opts.ulysses_size > 1 else "packed" if opts.padding_free else "padded"]
    probe = _top1_probe(models["padded"])
    with torch.no_grad():
        lp, top1 = token_log_probs_and_top1(model, probe, CPU, opts)
        plain_lp, _ = token_log_probs(model, probe, CPU, 1.0, False, opts)
    return [lp[0].tolist(), top1[0].tolist(), plain_lp[0].tolist()]


def _worker(rank: int, world: int, model_dir: str, out: str) -> None:

    from easyrl.workers.ulysses import enable_sequence_parallel
    from easyrl.workers.varlen import register_varlen_attention

    init_rank(rank, world)
    models = _models(model_dir, enable_sequence_parallel(world, register_varlen_attention()))
    found = {
        "values": {
            f"{name}@{t}": _run(models, opts, t) for name, opts in {**PATHS, **SP_PATHS}.items() for t in (1, 0.7)
        },
        "refusals": {name: _refusal(models, opts) for name, opts in {**PATHS, **SP_PATHS}.items()},
        "metric": {name: _run_metric(models, opts) for name, opts in {**PATHS, **SP_PATHS}.items()},
        "top1": {name: _run_top1(models, opts) for name, opts in {**PATHS, **SP_PATHS}.items()},
    }
    if rank == 0:
        Path(out).write_text(json.dumps(found))
    close_rank()


@pytest.fixture(scope="module")
def probe_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from easyrl.testing.tiny import build_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("head")
    model_dir = build_tiny_checkpoint(tmp / "qwen2", arch="qwen2", num_heads=4, num_kv_heads=2)
    out = tmp / "probe.json"
    run_ranks(_worker, WORLD, model_dir, str(out))
    return dict(json.loads(out.read_text()))


@pytest.mark.parametrize("temperature", [1, 0.7])
def test_probe_gives_the_same_log_probs_on_every_path(probe_results: dict[str, Any], temperature: float) -> None:
    values = {
        k.split("@")[0]: torch.tensor(v) for k, v in probe_results["values"].items() if k.endswith(f"@{temperature}")
    }
    assert set(values) == set(PATHS) | set(SP_PATHS)
    plain = values["plain"]
    assert plain.shape == (2, 4) and torch.isfinite(plain).all() and (plain[0] < 0).all()
    for name, got in values.items():
        # Float reduction order differs between attention kernels and head chunkings; nothing else may.
        torch.testing.assert_close(got, plain, atol=2e-6, rtol=0, msg=f"{name} at temperature {temperature}")


def test_entropy_metric_is_the_entropy_without_a_graph_on_every_path(probe_results: dict[str, Any]) -> None:
    """`entropy_grad=False` (the update's `actor/entropy` without a bonus) gives each path's entropy, detached, while
    the log-probs of the same forward keep their graph."""
    assert set(probe_results["metric"]) == set(PATHS) | set(SP_PATHS)
    for name, (ent, ent_grad, lp_grad) in probe_results["metric"].items():
        want = torch.tensor(probe_results["values"][f"{name}@0.7"][1])
        torch.testing.assert_close(torch.tensor(ent), want, atol=2e-6, rtol=0, msg=name)
        assert (ent_grad, lp_grad) == (False, True), name


def test_temperature_changes_the_log_probs(probe_results: dict[str, Any]) -> None:
    """The probe is not blind to temperature: every path applies it (once)."""
    values = probe_results["values"]
    for name in (*PATHS, *SP_PATHS):
        assert abs(values[f"{name}@1"][0][0] - values[f"{name}@0.7"][0][0]) > 1e-3, name


def test_top1_flags_mark_the_models_first_choices_on_every_path(probe_results: dict[str, Any]) -> None:
    """SFT's token accuracy: 1 where the response token is the argmax (responses 0 and 2), 0 where it is the second
    choice; the log-probs beside them are `token_log_probs`' at temperature 1."""
    assert set(probe_results["top1"]) == set(PATHS) | set(SP_PATHS)
    for name, (lp, top1, plain_lp) in probe_results["top1"].items():
        assert top1 == [1.0, 0.0, 1.0, 0.0], name
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(plain_lp), atol=2e-6, rtol=0, msg=name)


def test_training_at_temperature_zero_is_refused_on_every_path(probe_results: dict[str, Any]) -> None:
    for name, message in probe_results["refusals"].items():
        assert "worker.rollout.temperature" in message and "> 0" in message, (name, message)
        assert "\n" not in message, name


def test_scale_logits_refuses_greedy_and_keeps_temperature_one_exact() -> None:
    from easyrl.algorithms import scale_logits

    logits = torch.randn(3, 5, dtype=torch.bfloat16)
    assert torch.equal(scale_logits(logits, 1.0), logits.float())
    torch.testing.assert_close(scale_logits(logits, 0.5), logits.float() * 2)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"worker\.rollout\.temperature must be > 0"):
            scale_logits(logits, bad)


TOPK_PATHS = {
    "plain": ForwardOptions(),
    "trimmed": ForwardOptions(max_token_len=64),
    "packed": ForwardOptions(padding_free=True),
}


def _two_rows() -> Batch:
    """Two rows, left-padded prompts and right-padded responses: the layouts differ in what they pack or trim."""
    ids = torch.tensor([[0, 5, 17, 42, 8, 61, 0], [3, 4, 17, 42, 9, 61, 23]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    return Batch(
        {
            "prompts": ids[:, :4],
            "responses": ids[:, 4:],
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "response_mask": mask[:, 4:].clone(),
            "loss_mask": mask[:, 4:].clone(),
        }
    )


def test_top_k_log_probs_and_the_log_probs_at_given_ids_agree_on_every_unfused_layout(
    tiny_model_dir, monkeypatch
) -> None:
    """`topk_fkl`'s two heads: the teacher's top-k (ids and log-probs) and the student's log-probs at those ids, with
    their gradient, are the full log-softmax's at every valid response token, padded, trimmed or packed; the fused
    and split heads are refused with the keys to set."""
    from easyrl.workers.head import token_log_probs_at, top_k_log_probs

    monkeypatch.setattr("easyrl.workers.head.TOPK_CHUNK", 2)  # the teacher's log-softmax 2 positions at a time
    models, batch, k = _models(tiny_model_dir), _two_rows(), 3
    valid = batch["response_mask"].bool()
    with torch.no_grad():
        logits = models["padded"](
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
    reference = torch.log_softmax(logits[:, 3:-1].float() / 0.7, dim=-1)  # position P - 1 + c predicts column c
    ref_lp, ref_ids = reference.topk(k, dim=-1)
    for name, opts in TOPK_PATHS.items():
        model = models["packed" if opts.padding_free else "padded"]
        with torch.no_grad():
            sampled, top_lp, top_ids = top_k_log_probs(model, batch, CPU, 0.7, k, opts)
        assert torch.equal(top_ids[valid], ref_ids[valid]), name
        torch.testing.assert_close(top_lp[valid], ref_lp[valid], atol=1e-5, rtol=0, msg=name)
        expected_sampled = reference.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(sampled[valid], expected_sampled[valid], atol=1e-5, rtol=0, msg=name)
        model.zero_grad()
        lp, _, at = token_log_probs_at(model, batch, CPU, 0.7, top_ids, False, opts)
        torch.testing.assert_close(at[valid], ref_lp[valid], atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(lp[valid], expected_sampled[valid], atol=1e-5, rtol=0, msg=name)
        at[valid].sum().backward()  # the gradient reaches the weights through the k ids
        assert model.model.embed_tokens.weight.grad.abs().sum() > 0, name
    split = (ForwardOptions(padding_free=True, ulysses_size=2), ForwardOptions(padding_free=True, ring_size=2))
    for opts in (ForwardOptions(fused=True), *split):
        with pytest.raises(ValueError, match=r"fused_logprobs=false, worker\.actor\.ulysses_size=1 and .*ring_size=1"):
            top_k_log_probs(models["padded"], batch, CPU, 0.7, k, opts)
