"""The multi-turn loop, token in and token out, on a real engine: the HF engine serving the tool demo's warm-started
model (assets/demo_tools, made by scripts/make_tool_demo_assets.py), which answers `37*84` either by guessing or by
calling `mul` from envs/calc.py.

What is shown: the rows keep the engine's contract (one per trajectory, sampled tokens trained, observation tokens
attended but `loss_mask` 0, log-probs only where sampled); the history is the sampled ids, never re-tokenized; the
exact-prefix rule, with a template that keeps the history and with templates that rewrite it; the token budget and
the turn limit, marked truncated; a one-turn trajectory samples as the single-turn loop does; and the policy loss
gets no gradient from observation tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from easyrl.agent import load_environments, parse_tool_calls
from easyrl.batch import Batch
from easyrl.config.multi_turn import MultiTurnConfig
from easyrl.rollout import SamplingParams, SingleTurnLoop
from easyrl.rollout.episode import apply_step
from easyrl.rollout.hf import HFRolloutEngine
from easyrl.rollout.multi_turn import (
    ChatRenderer,
    MultiTurnLoop,
    ToolSettings,
    TurnBudget,
    extend_transcript,
)
from easyrl.rollout.trajectory import Trajectory
from easyrl.seeding import SEED_COLUMN


REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "assets" / "demo_tools"
MODEL = str(ASSETS / "model")
CALC = f"{REPO / 'envs' / 'calc.py'}:CalcEnv"
PARAMS = SamplingParams(n=8, temperature=1.0, max_tokens=80, seed=7)

# The demo template with a history-rewriting twist: an assistant turn followed by another message is shown as
# `[called]` (as a context-compressing agent would); the turn being answered is shown as the model wrote it.
SUMMARISING = (
    "{%- if tools -%}{{- '<|im_start|>system\\ntools:' -}}"
    "{%- for tool in tools -%}{{- ' ' + tool['function']['name'] -}}{%- endfor -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set content = '[called]' if message['role'] == 'assistant' and not loop.last else message['content'] -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Qwen3's rule, in small: an assistant turn before the last user message loses its `<think>` block.
DROPS_THINKING = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for message in messages -%}{%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if message['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1] -%}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class LocalEngines:
    """An `EngineSession` in this process: the HF engine, each request split over `count` engine slots as
    `Dispatch.ENGINE_SPLIT` splits it (unevenly it refuses), and every row stamped with policy version 0."""

    def __init__(self, engine: HFRolloutEngine, count: int = 2) -> None:
        self.engine, self.count, self.calls, self.sessions = engine, count, 0, 0

    def open_rollout(self) -> dict[str, float]:
        self.sessions += 1
        return {}

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        assert len(prompts) % self.count == 0, f"{len(prompts)} rows do not split over {self.count} engines"
        self.calls += 1
        parts = [self.engine.generate(part, params) for part in prompts.chunk(self.count)]
        rows = Batch.concat(parts)
        return rows.set(policy_version=torch.zeros(len(rows), dtype=torch.int64))

    def close_rollout(self) -> dict[str, float]:
        return {}

    def generate_sequences(self, prompts: Batch, params: SamplingParams) -> tuple[Batch, dict[str, float]]:
        return self.generate(prompts, params), self.open_rollout() | self.close_rollout()


@pytest.fixture(scope="module")
def engine() -> HFRolloutEngine:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    return HFRolloutEngine(MODEL, torch.device("cpu"), torch.float32, [tok.eos_token_id], tok.pad_token_id)


@pytest.fixture(scope="module")
def chat() -> ChatRenderer:
    from transformers import AutoTokenizer

    return ChatRenderer(AutoTokenizer.from_pretrained(MODEL))


def _rows(count: int) -> list[dict[str, Any]]:
    lines = (ASSETS / "val.jsonl").read_text().splitlines()[:count]
    return [json.loads(line) for line in lines]


def _prompts(rows: list[dict[str, Any]]) -> Batch:
    """What the trainer hands a loop: the prompts' driver columns (the multi-turn loop renders its own ids)."""
    ids = torch.zeros(len(rows), 1, dtype=torch.long)
    return Batch(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.zeros_like(ids)},
        {"row": rows, "raw_prompt": [r["prompt"] for r in rows], "ground_truth": [r["answer"] for r in rows]},
    )


def _loop(chat: ChatRenderer, template: str | None = None, **budget: int) -> MultiTurnLoop:
    envs = load_environments(MultiTurnConfig(env=CALC), lambda row: [])
    limits = {"max_turns": 4, "max_total_tokens": 80, "max_tokens_per_turn": 80, "max_prompt_length": 64} | budget
    renderer = ChatRenderer(chat.tokenizer, template)
    return MultiTurnLoop(envs, renderer, TurnBudget(**limits), ToolSettings(5.0, 200, 4), engines=2)


@pytest.fixture(scope="module")
def rollout(engine: HFRolloutEngine, chat: ChatRenderer) -> tuple[Batch, dict[str, float], LocalEngines]:
    engines = LocalEngines(engine)
    rows, metrics = _loop(chat).run(engines, _prompts(_rows(4)), PARAMS)
    return rows, metrics, engines


def _response(rows: Batch, i: int) -> tuple[list[int], list[int]]:
    length = int(rows["response_mask"][i].sum())
    return rows["responses"][i, :length].tolist(), rows["loss_mask"][i, :length].tolist()


def _callers(rows: Batch) -> list[int]:
    return [i for i, row in enumerate(rows["row"]) if row["tool_calls"] > 0]


def test_rows_hold_sampled_tokens_trained_and_tool_output_attended_only(
    rollout: tuple[Batch, dict[str, float], LocalEngines], chat: ChatRenderer
) -> None:
    rows, metrics, engines = rollout
    assert len(rows) == 4 * PARAMS.n and engines.sessions == 1  # one session, one engine call per turn
    callers = _callers(rows)
    assert callers and len(callers) < len(rows), "the warm model calls the tool in some answers, not all"
    assert engines.calls == metrics["multi_turn/turns_max"] == 2
    assert metrics["multi_turn/tool_call_rate"] == len(callers) / len(rows)
    eos = chat.tokenizer.eos_token_id
    for i in callers:
        row = rows["row"][i]
        ids, mask = _response(rows, i)
        first = mask.index(0)  # the first completion (trained), then the observation (not), then the answer
        observation = mask.index(1, first)
        assert set(mask[:first]) == {1} and ids[first - 1] == eos and set(mask[first:observation]) == {0}
        call = row["conversation"][1]["content"]
        assert call == chat.decode(ids[: first - 1])  # the assistant turn is the text of the sampled ids
        [parsed] = parse_tool_calls(call)
        tool = row["conversation"][2]
        want = str(parsed.arguments["a"] * parsed.arguments["b"]) if parsed.error is None else tool["content"]
        assert tool["role"] == "tool" and tool["content"] == want  # the environment's mul ran on the model's arguments
        assert chat.decode(ids[first:observation]) == f"\n<|im_start|>tool\n{want}<|im_end|>\n<|im_start|>assistant\n"
        assert row["stop_reason"] == "answer" and row["turns"] == 2
        assert row["final_response"] == chat.decode(ids[observation:-1])
        # log-probs only where the engine sampled
        lp = rows["rollout_log_probs"][i, : len(ids)]
        assert (lp[torch.tensor(mask) == 0] == 0).all() and (lp[torch.tensor(mask) == 1] < 0).all()
    for i in set(range(len(rows))) - set(callers):
        ids, mask = _response(rows, i)
        assert set(mask) == {1} and rows["row"][i]["stop_reason"] == "answer" and rows["row"][i]["turns"] == 1
    prompt = rows["raw_prompt"][0]
    assert prompt.startswith("<|im_start|>system\ntools: mul<|im_end|>")  # the schema reached the model's template
    assert metrics["multi_turn/observation_tokens_mean"] > 0 and metrics["multi_turn/truncated"] == 0
    assert metrics["multi_turn/split_trajectories"] == 0 and metrics["multi_turn/tool_errors"] >= 0


def test_the_history_is_the_sampled_ids_and_one_turn_samples_as_the_single_turn_loop(
    rollout: tuple[Batch, dict[str, float], LocalEngines], engine: HFRolloutEngine, chat: ChatRenderer
) -> None:
    rows, _, _ = rollout
    # The single-turn loop on the same rendered prompts and seed draws every first completion of the multi-turn one.
    texts = list(dict.fromkeys(rows["raw_prompt"]))
    encoded = [chat.encode(t) for t in texts]
    width = max(len(e) for e in encoded)
    ids = torch.tensor([[chat.tokenizer.pad_token_id] * (width - len(e)) + e for e in encoded])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(e) for e in encoded])[:, None]).long()
    prompts = Batch({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)})
    prompts.non_tensors["row"] = [{}] * len(texts)
    single, _ = SingleTurnLoop().run(LocalEngines(engine), prompts, PARAMS)
    for i in range(len(rows)):
        ids_i, mask_i = _response(rows, i)
        first = mask_i.index(0) if 0 in mask_i else len(ids_i)
        want = single["responses"][i, : int(single["response_mask"][i].sum())].tolist()
        assert ids_i[:first] == want
        # token in, token out: the row is the prompt's ids and then exactly the ids that were appended
        length = int(rows["attention_mask"][i].sum())
        assert (
            rows["input_ids"][i][rows["attention_mask"][i].bool()].tolist()[:length]
            == chat.encode(rows["raw_prompt"][i]) + ids_i
        )


def test_the_exact_prefix_rule_keeps_sampled_ids_and_starts_a_new_sample_when_the_template_rewrites_history(
    chat: ChatRenderer,
) -> None:
    tok = chat.tokenizer
    messages: list[dict[str, Any]] = [{"role": "user", "content": "7*8?"}]
    for template, rewrites in ((None, False), (DROPS_THINKING, True)):
        renderer = ChatRenderer(tok, template)
        convo = [dict(m) for m in messages]
        prompt = renderer.render(convo, [])
        traj = Trajectory(renderer.encode(prompt))
        # the model spelled `<think>` out character by character: decoding and re-tokenizing would give the single
        # `<think>` token instead, another sequence than the one sampled
        completion = "<think>7*8</think>56"
        sampled = [tok.convert_tokens_to_ids(c) for c in completion] + [tok.eos_token_id]
        assert renderer.encode(completion) != sampled[:-1]
        traj.append(sampled, trained=True, log_probs=[-1.0] * len(sampled), version=0)
        text = prompt + renderer.decode(sampled)
        convo += [{"role": "assistant", "content": completion}, {"role": "user", "content": "and 9*9?"}]
        rendered = renderer.render(convo, [])
        step = extend_transcript(text, rendered, renderer)
        apply_step(traj, step)
        if not rewrites:
            added = len(step.observation)
            assert step.prompt is None and added > 0
            assert traj.response_ids[: len(sampled)] == sampled  # the history as sampled, never re-tokenized
            assert traj.loss_mask == [1] * len(sampled) + [0] * added
            assert (
                renderer.decode(traj.response_ids[len(sampled) :])
                == "\n<|im_start|>user\nand 9*9?<|im_end|>\n<|im_start|>assistant\n"
            )
        else:
            assert step.observation == [] and traj.response_ids == [] and traj.loss_mask == []
            assert "<think>" not in rendered and traj.prompt_ids == step.prompt == renderer.encode(rendered)
        # a tool message is no user message: the thinking stays, and the turn stays one sample with either template
        tool_convo = [*convo[:2], {"role": "tool", "content": "56"}]
        assert extend_transcript(text, renderer.render(tool_convo, []), renderer).prompt is None


def test_a_template_that_rewrites_history_starts_a_new_sample_and_trains_the_last(
    engine: HFRolloutEngine, chat: ChatRenderer
) -> None:
    rows, metrics = _loop(chat, SUMMARISING).run(LocalEngines(engine), _prompts(_rows(4)), PARAMS)
    callers = _callers(rows)
    assert callers and metrics["multi_turn/split_trajectories"] == len(callers)
    set_aside = 0
    for i in callers:
        _, mask = _response(rows, i)
        assert set(mask) == {1}  # the new sample's response is the answer alone
        prompt = rows["raw_prompt"][i]
        assert "<|im_start|>assistant\n[called]<|im_end|>\n<|im_start|>tool\n" in prompt
        assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
        # every completion before the answer was a sample the template rewrote (one per tool call), with its EOS
        turns = [m["content"] for m in rows["row"][i]["conversation"] if m["role"] == "assistant"]
        assert len(turns) == rows["row"][i]["turns"]
        set_aside += sum(len(chat.encode(turn)) + 1 for turn in turns[:-1])
    assert metrics["multi_turn/untrained_tokens"] == set_aside  # the earlier samples, counted, not trained


def test_the_token_budget_and_the_turn_limit_end_trajectories_marked_truncated(
    engine: HFRolloutEngine, chat: ChatRenderer
) -> None:
    rows, metrics = _loop(chat, max_total_tokens=30).run(LocalEngines(engine), _prompts(_rows(4)), PARAMS)
    assert int(rows["response_mask"].sum(1).max()) <= 30
    cut = [r for r in rows["row"] if r["stop_reason"] in ("budget", "length")]
    assert cut and all(r["truncated"] for r in cut) and metrics["multi_turn/truncated"] == len(cut) / len(rows)
    rows, metrics = _loop(chat, max_turns=1).run(LocalEngines(engine), _prompts(_rows(4)), PARAMS)
    callers = _callers(rows)
    assert callers and all(rows["row"][i]["stop_reason"] == "max_turns" for i in callers)
    assert metrics["multi_turn/observation_tokens_mean"] == 0 and metrics["multi_turn/turns_max"] == 1
    assert all(rows["row"][i]["truncated"] for i in callers)


def test_the_policy_loss_gets_no_gradient_from_observation_tokens(
    rollout: tuple[Batch, dict[str, float], LocalEngines],
) -> None:
    """Zero gradient from observation tokens, and the same loss and gradient whatever their per-token values."""
    from transformers import AutoModelForCausalLM

    from easyrl.workers.actor import policy_objective
    from easyrl.workers.head import token_log_probs
    from tests.conftest import ppo_kl_loss

    rows, _, _ = rollout
    callers = _callers(rows)
    batch = rows.index(callers)
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    g = torch.Generator().manual_seed(0)
    shape = batch["responses"].shape
    batch.set(
        old_log_probs=batch["rollout_log_probs"].clone(),
        ref_log_probs=batch["rollout_log_probs"] + 0.1 * torch.randn(shape, generator=g),
        advantages=torch.randn(len(batch), 1, generator=g).expand(shape).clone(),
    )
    observation = (batch["response_mask"] == 1) & (batch["loss_mask"] == 0)
    trained = batch["loss_mask"] == 1
    assert observation.any() and trained.any()

    def loss_and_grads(b: Batch) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        lp, ent = token_log_probs(model, b, torch.device("cpu"), 1.0, with_entropy=True)
        lp.retain_grad()
        out = policy_objective(b, lp, ent, ppo_kl_loss(), "token-mean", 0.01)
        out.loss.backward()
        assert lp.grad is not None
        return (
            float(out.loss.detach()),
            lp.grad.clone(),
            [p.grad.clone() for p in model.parameters() if p.grad is not None],
        )

    loss, lp_grad, grads = loss_and_grads(batch)
    assert (lp_grad[observation] == 0).all() and (lp_grad[trained] != 0).any()
    # junk at the observation positions of every per-token input the loss reads: nothing moves
    junk = Batch(dict(batch.tensors), dict(batch.non_tensors))
    for key in ("old_log_probs", "ref_log_probs", "advantages"):
        noisy = junk[key].clone()
        noisy[observation] = 100.0 * torch.randn(int(observation.sum()), generator=g)
        junk.set(**{key: noisy})
    loss2, lp_grad2, grads2 = loss_and_grads(junk)
    assert loss2 == pytest.approx(loss, rel=1e-6)
    torch.testing.assert_close(lp_grad2, lp_grad)
    for a, b in zip(grads, grads2):
        torch.testing.assert_close(a, b)


def test_seeded_rollouts_repeat_and_do_not_depend_on_the_engine_split(
    rollout: tuple[Batch, dict[str, float], LocalEngines], engine: HFRolloutEngine, chat: ChatRenderer
) -> None:
    rows, _, _ = rollout
    again, _ = _loop(chat).run(LocalEngines(engine, count=1), _prompts(_rows(4)), PARAMS)
    torch.testing.assert_close(again["input_ids"], rows["input_ids"], rtol=0, atol=0)
    assert SEED_COLUMN not in again
