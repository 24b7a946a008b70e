"""Make the assets of the tool demo (`easyrl train configs/demo_tools.yaml`): a tiny warm-started model and its data.

The task: multiply two 2-digit numbers (`37*84` -> `3108`). The tiny model cannot multiply, but it has a tool,
`mul` (envs/calc.py), called in the Hermes format its chat template teaches:

    <|im_start|>assistant\n<tool_call>{"name":"mul","arguments":{"a":37,"b":84}}</tool_call><|im_end|>
    <|im_start|>tool\n3108<|im_end|>
    <|im_start|>assistant\n3108<|im_end|>

A short supervised warm start (plain torch, cross-entropy on the assistant tokens only) teaches both ways to answer,
mixed `--call-share` (0.2) to 0.8: calling the tool and copying its result, or writing a product straight away (a
guess: right about 1 time in 100). Sampled at temperature 1, the warm model calls the tool in about a fifth of its
answers, and more than half of those end with the right product: reward starts near 0.1 and the tool-call rate
near 0.2, and RL has one thing to find, that calling pays (reward_functions/calc.py: 1 for the right product, 0 otherwise). The model's tokenizer is the
tiny character tokenizer plus `<tool_call>` and `</tool_call>` as single tokens (as Qwen2.5's), and its chat template
names the tools in a system line (`tools: mul`): the schema reaches the model through its own template.

The conversations are rendered by the same template and cut into the same pieces the multi-turn loop appends
(prompt, completion, observation), so the warm start sees exactly the tokens RL will.

Outputs (under `--out`, default `assets/demo_tools`): `model/` (a Hugging Face folder), `train.jsonl` and
`val.jsonl` with rows `{"prompt": "37*84", "answer": "3108", "a": 37, "b": 84}`. Seeded (one torch thread). The
shipped model took 800 steps, 335 s on a busy 2-core machine, and samples (T=1, validation rows): tool-call rate
0.19, 83% of the calls well formed, reward 0.11.
Usage: `python scripts/make_tool_demo_assets.py [--out assets/demo_tools] [--seed 1]`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from easyrl.testing.tiny import build_model, make_tokenizer, save_checkpoint  # noqa: E402


logger = logging.getLogger("make_tool_demo_assets")

CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\ntools:' -}}"
    "{%- for tool in tools -%}{{- ' ' + tool['function']['name'] -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""ChatML with a system line naming the tools; a tool's output is a message of role `tool`."""
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
MUL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "mul",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def make_demo_tokenizer() -> Any:
    """The tiny character tokenizer with the tool-call tags as single tokens and the tool-aware template."""
    from tokenizers import AddedToken

    tokenizer = make_tokenizer()
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_rows(rng: random.Random, count: int) -> list[dict[str, Any]]:
    """`count` distinct products of two 2-digit numbers."""
    rows: dict[str, dict[str, Any]] = {}
    while len(rows) < count:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.setdefault(f"{a}*{b}", {"prompt": f"{a}*{b}", "answer": str(a * b), "a": a, "b": b})
    return list(rows.values())


def call_text(a: int, b: int) -> str:
    call = json.dumps({"name": "mul", "arguments": {"a": a, "b": b}}, separators=(",", ":"))
    return f"<tool_call>{call}</tool_call>"


def example(tokenizer: Any, row: dict[str, Any], call: bool) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 off the assistant's tokens) of one conversation, cut where the loop cuts it."""
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    render = lambda msgs: tokenizer.apply_chat_template(  # noqa: E731
        msgs, tools=[MUL_SCHEMA], add_generation_prompt=True, tokenize=False
    )
    messages = [{"role": "user", "content": row["prompt"]}]
    prompt = render(messages)
    ids, labels = enc(prompt), [-100] * len(enc(prompt))
    if call:
        first = call_text(row["a"], row["b"])
        ids += enc(first + "<|im_end|>")
        labels += enc(first + "<|im_end|>")
        messages += [{"role": "assistant", "content": first}, {"role": "tool", "content": row["answer"]}]
        full = render(messages)
        observation = full[len(prompt + first + "<|im_end|>") :]
        assert full.startswith(prompt + first + "<|im_end|>"), "the template must extend the conversation"
        ids += enc(observation)
        labels += [-100] * len(enc(observation))
    answer = enc(row["answer"] + "<|im_end|>")
    return ids + answer, labels + answer


def batch(tokenizer: Any, rows: list[dict[str, Any]], rng: random.Random, share: float) -> tuple[torch.Tensor, ...]:
    pairs = [example(tokenizer, row, rng.random() < share) for row in rows]
    width = max(len(ids) for ids, _ in pairs)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in pairs])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in pairs])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in pairs])
    return ids, mask, labels


@torch.no_grad()
def evaluate(model: Any, tokenizer: Any, rows: list[dict[str, Any]], seed: int) -> dict[str, float]:
    """Sample the first turn at temperature 1 and, for calls, the answer after the true tool output: the tool-call
    rate, the share of calls written right, and the share of episodes ending with the right product."""
    model.eval()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], tools=[MUL_SCHEMA], add_generation_prompt=True, tokenize=False
        )
        for r in rows
    ]
    firsts = _sample(model, tokenizer, prompts, seed, 60)
    calls = [i for i, f in enumerate(firsts) if f.startswith("<tool_call>")]
    good = [i for i in calls if firsts[i] == call_text(rows[i]["a"], rows[i]["b"])]
    right = sum(firsts[i].strip() == rows[i]["answer"] for i in range(len(rows)) if i not in calls)
    contexts = [
        prompts[i]
        + firsts[i]
        + "<|im_end|>\n<|im_start|>tool\n"
        + rows[i]["answer"]
        + "<|im_end|>\n<|im_start|>assistant\n"
        for i in good
    ]
    answers = _sample(model, tokenizer, contexts, seed + 1, 8) if contexts else []
    right += sum(a.strip() == rows[i]["answer"] for a, i in zip(answers, good))
    model.train()
    return {
        "call_rate": len(calls) / len(rows),
        "well_formed": len(good) / max(len(calls), 1),
        "reward": right / len(rows),
    }


def _sample(model: Any, tokenizer: Any, texts: list[str], seed: int, limit: int) -> list[str]:
    """One sample at temperature 1 per text (left-padded batch), up to the end of the turn."""
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=limit,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def warm_start(model: Any, tokenizer: Any, rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    model.train()
    start = time.time()
    stats: dict[str, float] = {}
    for step in range(1, args.max_steps + 1):
        ids, mask, labels = batch(tokenizer, rng.sample(rows, args.batch_size), rng, args.call_share)
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.eval_every == 0:
            stats = evaluate(model, tokenizer, rows[:128], seed=step)
            logger.info("step %d loss %.3f %s (%.0fs)", step, loss.item(), _fmt(stats), time.time() - start)
            if stats["well_formed"] >= args.target_well_formed and step >= args.min_steps:
                break
    return {"steps": step, "seconds": time.time() - start, **stats}


def _fmt(stats: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.2f}" for k, v in stats.items())


def write_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "assets", "demo_tools"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--train-rows", type=int, default=2000)
    p.add_argument("--val-rows", type=int, default=64)
    p.add_argument("--call-share", type=float, default=0.2, help="share of warm-start answers that call the tool")
    p.add_argument("--target-well-formed", type=float, default=0.9, help="stop once this share of calls is right")
    p.add_argument("--min-steps", type=int, default=300)
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (fixed, for reproducible bytes)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    rows = make_rows(random.Random(args.seed), args.train_rows + args.val_rows)
    train_rows, val_rows = rows[: args.train_rows], rows[args.train_rows :]
    model_dir = os.path.join(args.out, "model")
    tokenizer = make_demo_tokenizer()
    build_model(model_dir, arch="qwen2", seed=args.seed, tokenizer=tokenizer, num_heads=2, num_kv_heads=1)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    info = warm_start(model, tokenizer, train_rows, args)
    save_checkpoint(model, tokenizer, model_dir)
    write_jsonl(os.path.join(args.out, "train.jsonl"), train_rows)
    write_jsonl(os.path.join(args.out, "val.jsonl"), val_rows)
    final = evaluate(model, tokenizer, val_rows, seed=12345)
    logger.info("warm start: %d steps in %.0fs; val (T=1): %s", info["steps"], info["seconds"], _fmt(final))


if __name__ == "__main__":
    main()
