"""Make the assets of the demo run (`easyrl train configs/demo.yaml`): a tiny warm-started model and its data.

The task is synthetic and verifiable: the prompt asks to copy or to reverse a short list of digits, e.g.

    Copy: 4 9 2 7      ->  4927
    Reverse: 3 8 1     ->  183

and `reward_functions/digits.py` gives partial credit (digits in the right place, plus a little for answering with
digits only and stopping at the right length).

A randomly initialised 2-layer model cannot discover this task by RL in a few dozen steps, so this script first
gives it a short supervised warm start (plain torch, cross-entropy on the answer tokens) until the mean reward of
responses sampled at temperature 1.0 reaches `--target-reward` (0.85). Then it makes room for RL: it divides the
final RMSNorm weight (the embeddings are tied, so this scales the logits) by the smallest baked-in temperature
from a fixed grid that brings the sampled reward down to `--soft-reward` (0.3). Greedy answers are unchanged
(mean reward ~0.9), but responses sampled at temperature 1.0, as in the RL run, are mostly wrong (~0.25): the
model knows the task and RL has a clear, reachable target, sharpening its distribution. (Merely stopping the
warm start early does not work: a half-trained tiny model is mid-way through a phase transition that RL's weak
signal does not finish in a few dozen steps.) In a plain GRPO loop (16 prompts x 8 samples, AdamW lr 1e-3, no KL)
the mean training reward climbs from ~0.25 to ~0.75 in 60 steps; lr 1e-4 still gains ~0.3.

Outputs (under `--out`, default `assets/demo`):

- `model/`: a Hugging Face folder (config, safetensors, tokenizer, chat template, generation config);
- `train.jsonl` and `val.jsonl`: rows `{"prompt": "Reverse: 3 8 1", "answer": "183"}`.

Everything is seeded; on the same machine and thread count the outputs are byte-identical. Runtime: about a minute
on 2 CPU cores (the warm start's length depends on the seed: the task is learnt in a sudden transition).
Usage: `python scripts/make_demo_assets.py [--out assets/demo] [--seed 1]`.

The same warm start with `easyrl sft` (configs/demo_sft.yaml; docs/sft.md has the figures):

- `--sft-data DIR` writes what the warm start starts from and trains on, and trains nothing: `DIR/init_model/` (the
  same random init), `DIR/train.parquet` (the very rows the warm start draws, batch after batch, for `--sft-steps`
  steps, as `messages` conversations: in order, 64 rows a step, they replay its batches; parquet with zstd, 0.3 MB
  where jsonl is 3.6 MB, so the repository ships them in assets/demo_sft) and `DIR/val.jsonl` (the demo's
  validation rows);
- `--soften MODEL --out DIR` bakes the temperature into a trained model (`easyrl merge`'s output) as above and writes
  it to `DIR`, ready for `easyrl train configs/demo.yaml worker.actor.model.model_path=DIR`.
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


logger = logging.getLogger("make_demo_assets")

TASKS = ("Copy", "Reverse")
MIN_DIGITS = 3
MAX_DIGITS = 6
MAX_NEW_TOKENS = 16
"""Response budget used when measuring the warm start (the demo's `max_response_length`)."""


def load_reward() -> Any:
    """Import `reward_functions/digits.py` (it is a plain file, not a package module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("digits_reward", os.path.join(ROOT, "reward_functions", "digits.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_row(rng: random.Random) -> dict[str, str]:
    """One task instance: a prompt and its answer."""
    task = rng.choice(TASKS)
    digits = [str(rng.randrange(10)) for _ in range(rng.randint(MIN_DIGITS, MAX_DIGITS))]
    answer = digits[::-1] if task == "Reverse" else digits
    return {"prompt": f"{task}: {' '.join(digits)}", "answer": "".join(answer)}


def make_rows(rng: random.Random, count: int) -> list[dict[str, str]]:
    """`count` distinct task instances."""
    rows: dict[str, dict[str, str]] = {}
    while len(rows) < count:
        row = make_row(rng)
        rows.setdefault(row["prompt"], row)
    return list(rows.values())


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of the chat-formatted prompt, generation prompt included."""
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def sft_batch(tokenizer: Any, rows: list[dict[str, str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (loss on the answer and its EOS only)."""
    seqs, labels = [], []
    for row in rows:
        p = prompt_ids(tokenizer, row["prompt"])
        a = [*tokenizer.encode(row["answer"], add_special_tokens=False), tokenizer.eos_token_id]
        seqs.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    lab = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
    return ids, mask, lab


@torch.no_grad()
def evaluate(
    model: Any, tokenizer: Any, rows: list[dict[str, str]], reward: Any, sample: bool, n: int = 1, seed: int = 0
) -> dict[str, float]:
    """Mean reward scores of responses to `rows` (sampled at temperature 1.0 `n` times each, or greedy)."""
    model.eval()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        for r in rows
    ]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    kwargs: dict[str, Any] = {"do_sample": False}
    if sample:
        kwargs = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "num_return_sequences": n}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = model.generate(**enc, max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.pad_token_id, **kwargs)
    responses = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    reps = n if sample else 1
    inputs = [
        {"response": resp, "response_length": 0, "ground_truth": rows[i // reps]["answer"]}
        for i, resp in enumerate(responses)
    ]
    scores = reward.compute_score(inputs)
    model.train()
    return {key: sum(s[key] for s in scores) / len(scores) for key in scores[0]}


def warm_start(
    model: Any, tokenizer: Any, eval_rows: list[dict[str, str]], reward: Any, args: argparse.Namespace
) -> dict[str, Any]:
    """Supervised warm start until the sampled mean reward reaches `args.target_reward`."""
    rng = random.Random(args.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    model.train()
    start = time.time()
    history = []
    for step in range(1, args.max_steps + 1):
        ids, mask, labels = sft_batch(tokenizer, [make_row(rng) for _ in range(args.batch_size)])
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.eval_every == 0:
            sampled = evaluate(model, tokenizer, eval_rows, reward, sample=True, n=4, seed=step)
            greedy = evaluate(model, tokenizer, eval_rows, reward, sample=False)
            history.append((step, loss.item(), sampled["overall"], greedy["overall"]))
            logger.info(
                "step %d  loss %.3f  reward sampled %.3f greedy %.3f  (%.0fs)",
                step,
                loss.item(),
                sampled["overall"],
                greedy["overall"],
                time.time() - start,
            )
            if sampled["overall"] >= args.target_reward:
                break
    return {"steps": step, "seconds": time.time() - start, "history": history}


def soften(model: Any, tokenizer: Any, eval_rows: list[dict[str, str]], reward: Any, target: float) -> float:
    """Bake a sampling temperature into the model until its sampled reward drops to `target`; return it.

    The final RMSNorm weight scales the logits (the embeddings are tied), so dividing it by `tau` is exactly
    sampling at temperature `tau`. Greedy answers are unchanged.
    """
    norm = model.model.norm.weight
    base = norm.detach().clone()
    tau = 1.0
    for tau in (1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0, 3.5, 4.0, 5.0, 6.0):
        with torch.no_grad():
            norm.copy_(base / tau)
        sampled = evaluate(model, tokenizer, eval_rows, reward, sample=True, n=4, seed=int(tau * 100))
        logger.info("baked temperature %.2f: sampled reward %.3f", tau, sampled["overall"])
        if sampled["overall"] <= target:
            break
    return tau


def as_conversation(row: dict[str, str]) -> dict[str, list[dict[str, str]]]:
    """A task row as an SFT conversation: the prompt as the user's message, the answer as the assistant's."""
    return {"messages": [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["answer"]}]}


def write_sft_data(args: argparse.Namespace) -> None:
    """`--sft-data`: the warm start's initial model, its stream of training rows (`warm_start` draws them with the
    same generator, `--batch-size` a step) and the demo's validation rows, as conversations."""
    out = args.sft_data
    os.makedirs(out, exist_ok=True)
    rows = make_rows(random.Random(args.seed), args.train_rows + args.val_rows)
    build_model(os.path.join(out, "init_model"), arch="qwen2", seed=args.seed, tokenizer=make_tokenizer())
    rng = random.Random(args.seed + 1)
    stream = [make_row(rng) for _ in range(args.sft_steps * args.batch_size)]
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([as_conversation(r) for r in stream])
    pq.write_table(table, os.path.join(out, "train.parquet"), compression="zstd", compression_level=19)
    write_jsonl(os.path.join(out, "val.jsonl"), [as_conversation(r) for r in rows[args.train_rows :]])
    logger.info(
        "wrote %s: init_model/, train.parquet (%d rows = %d steps), val.jsonl", out, len(stream), args.sft_steps
    )


def soften_model(args: argparse.Namespace) -> None:
    """`--soften MODEL --out DIR`: the trained model's rewards, then the baked-in temperature, as after the warm start."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reward = load_reward()
    tokenizer = AutoTokenizer.from_pretrained(args.soften)
    model = AutoModelForCausalLM.from_pretrained(args.soften, dtype=torch.float32)
    rows = make_rows(random.Random(args.seed), args.train_rows + args.val_rows)
    val_rows = rows[args.train_rows :]
    for name, sample in (("sampled (T=1.0, n=8)", True), ("greedy", False)):
        scores = evaluate(model, tokenizer, val_rows, reward, sample=sample, n=8, seed=12345)
        logger.info("trained model: val mean reward, %s: %s", name, {k: round(v, 3) for k, v in scores.items()})
    tau = soften(model, tokenizer, make_rows(random.Random(args.seed + 2), 128), reward, args.soft_reward)
    save_checkpoint(model, tokenizer, args.out)
    sampled = evaluate(model, tokenizer, val_rows, reward, sample=True, n=8, seed=12345)
    logger.info(
        "baked-in temperature %.2f; val mean reward, sampled: %s", tau, {k: round(v, 3) for k, v in sampled.items()}
    )


def write_jsonl(path: str, rows: list[dict[str, Any]]) -> None:
    """Write rows as JSON lines."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="output folder (default assets/demo; required with --soften)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--train-rows", type=int, default=2000)
    p.add_argument("--val-rows", type=int, default=64)
    p.add_argument("--target-reward", type=float, default=0.85, help="stop the warm start at this sampled reward")
    p.add_argument("--soft-reward", type=float, default=0.3, help="bake in a temperature down to this reward")
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=2, help="torch threads (fixed, for reproducible bytes)")
    p.add_argument("--sft-data", default=None, help="write the warm start's model and rows for `easyrl sft` here")
    p.add_argument("--sft-steps", type=int, default=550, help="warm-start steps the --sft-data rows replay")
    p.add_argument("--soften", default=None, help="a trained model folder to bake the temperature into (to --out)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Build the tokenizer and model, warm-start it, and write the model and the data."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    if args.sft_data is not None:
        return write_sft_data(args)
    if args.soften is not None:
        if args.out is None:  # never overwrite the shipped demo model by default
            raise SystemExit("--soften needs --out: the folder to write the softened model to")
        return soften_model(args)
    args.out = args.out or os.path.join(ROOT, "assets", "demo")
    reward = load_reward()
    rng = random.Random(args.seed)
    rows = make_rows(rng, args.train_rows + args.val_rows)
    train_rows, val_rows = rows[: args.train_rows], rows[args.train_rows :]

    model_dir = os.path.join(args.out, "model")
    tokenizer = make_tokenizer()
    build_model(model_dir, arch="qwen2", seed=args.seed, tokenizer=tokenizer)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    eval_rows = make_rows(random.Random(args.seed + 2), 128)
    info = warm_start(model, tokenizer, eval_rows, reward, args)
    tau = soften(model, tokenizer, eval_rows, reward, args.soft_reward)
    save_checkpoint(model, tokenizer, model_dir)
    write_jsonl(os.path.join(args.out, "train.jsonl"), train_rows)
    write_jsonl(os.path.join(args.out, "val.jsonl"), val_rows)

    sampled = evaluate(model, tokenizer, val_rows, reward, sample=True, n=8, seed=12345)
    greedy = evaluate(model, tokenizer, val_rows, reward, sample=False)
    logger.info("warm start: %d steps in %.1fs; baked-in temperature %.2f", info["steps"], info["seconds"], tau)
    logger.info("val mean reward, sampled (T=1.0, n=8): %s", {k: round(v, 3) for k, v in sampled.items()})
    logger.info("val mean reward, greedy:              %s", {k: round(v, 3) for k, v in greedy.items()})
    if sampled["overall"] > 0.6:
        raise SystemExit(f"warm start went too far: sampled reward {sampled['overall']:.3f} leaves RL no headroom")


if __name__ == "__main__":
    main()
