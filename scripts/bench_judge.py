"""A judge-scored run of the digits demo learns: a fresh student trained on a judge's verdicts alone, its sampled
validation reward measured under the dataset's rule.

1. Judge: the demo run itself (`configs/demo.yaml`, GRPO, 80 steps, merged; `scripts/bench_distill.py` makes it the
   same way), served by vLLM (the CPU build, `easyrl.testing.vllm_server`) as an OpenAI-compatible server. vLLM's
   CPU attention takes no head size 16 (the demo model's), so the judge is served as an exact copy with 32-wide
   heads (`servable_copy`: zero-padded, checked to give the same logits).
2. Reward: `reward_functions/digits_judge.py` with `prompt_templates/digits_judge.jinja`: the judge answers each
   prompt itself (greedy) and each response is graded against the judge's answer by the digits formula. The
   dataset's answer never reaches the student's reward; the same function logs the response under it (`rule`) and
   whether the judge's answer was the dataset's (`judge_correct`), neither trained on.
3. The demo's fresh student (`assets/demo/model`) trains on that reward alone (everything else the demo's), with
   sampled validation (64 prompts x 4 at temperature 1) every `--val-every` steps. Prints one JSON line per run: the
   curve of `val/reward/rule` (the measured learning), of the judge's own reward and of the judge's correctness.
   `--runs` adds the student's own starting model as the judge (`fresh`) and GRPO on the rule itself (`grpo`).

    python scripts/bench_judge.py --workdir /tmp/judge --runs trained fresh grpo   # about 5 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import bench_distill  # noqa: E402  (the teacher maker, beside this script)


CURVES = {
    "rule": "val/reward/rule",
    "judge_reward": "val/reward/overall",
    "judge_correct": "val/reward/judge_correct",
    "judge_rule": "val/reward/judge_rule",
}
"""What the summary reports at each validation, and the logged key it comes from."""


def _pad_heads(weight: torch.Tensor, heads: int, old: int, new: int, rope: bool) -> torch.Tensor:
    """Rows of a q/k/v projection (or a bias) for `heads` heads of `old` dims, laid out for `new` dims, zeros between.
    With `rope`, dim i of a head moves to 2i and dim i + old/2 to 2i + new/2: rotary pairs (i, i + d/2) turn at
    theta^(-2i/d), so doubling d keeps each pair's frequency only at even positions."""
    grouped = weight.reshape(heads, old, *weight.shape[1:])
    out = weight.new_zeros(heads, new, *weight.shape[1:])
    half, step = old // 2, new // old
    if rope:
        out[:, 0 : new // 2 : step] = grouped[:, :half]
        out[:, new // 2 :: step] = grouped[:, half:]
    else:
        out[:, :old] = grouped
    return out.reshape(heads * new, *weight.shape[1:])


def servable_copy(model_dir: Path, out: Path, head_dim: int = 32) -> Path:
    """`model_dir` (a Qwen2 with head size 16) as a Llama with `head_dim`-wide heads that computes the same logits:
    q and k zero-padded where rotary keeps their frequencies, q scaled by sqrt(head_dim / 16) against the smaller
    attention scale, v padded and o_proj's columns with it, o_proj's bias (Llama has one with q/k/v biases) zero.
    The logits of both on a few prompts are compared before it is used."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").is_file():
        return out
    source = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = source.config
    old = cfg.hidden_size // cfg.num_attention_heads
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    state = {}
    for name, tensor in source.state_dict().items():
        t = tensor.detach().clone()
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            t = _pad_heads(t, heads, old, head_dim, rope=True) * (head_dim / old) ** 0.5
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            t = _pad_heads(t, kv_heads, old, head_dim, rope=True)
        elif name.endswith(("v_proj.weight", "v_proj.bias")):
            t = _pad_heads(t, kv_heads, old, head_dim, rope=False)
        elif name.endswith("o_proj.weight"):
            t = _pad_heads(t.T, heads, old, head_dim, rope=False).T.contiguous()
            state[name.replace("weight", "bias")] = torch.zeros(cfg.hidden_size)
        state[name] = t
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            attention_bias=True,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_parameters=dict(cfg.rope_parameters),
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=cfg.tie_word_embeddings,
            bos_token_id=cfg.bos_token_id,
            eos_token_id=cfg.eos_token_id,
            pad_token_id=cfg.pad_token_id,
        )
    )
    missing, unexpected = llama.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # lm_head: tied
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(["Copy: 4 1 7", "Reverse: 6 3 1 7 0 6 and more"], return_tensors="pt", padding=True)
    with torch.no_grad():
        gap = (source(**ids).logits - llama.eval()(**ids).logits).abs().max().item()
    if gap > 1e-4:
        raise RuntimeError(f"servable_copy: the padded model's logits differ from {model_dir}'s by {gap:.2e}")
    llama.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def judged_run(workdir: Path, judge_dir: Path, label: str, steps: int, val_every: int) -> dict[str, Any]:
    """Serve `judge_dir` (made servable), train the fresh student on its verdicts alone; the run's figures."""
    from easyrl.testing.vllm_server import VLLMServer

    served = servable_copy(judge_dir, workdir / f"{label}_served")
    start = time.perf_counter()
    with VLLMServer(str(served), workdir / f"{label}_server.log", name="digits-judge") as server:
        serve_s = time.perf_counter() - start
        rows, wall = bench_distill.train(
            workdir / f"{label}_run_{steps}",
            f"worker.reward.reward_function={REPO / 'reward_functions' / 'digits_judge.py'}:compute_score",
            f"worker.reward.judge.model.base_url={server.base_url}",
            "worker.reward.judge.model.name=judge",
            f"worker.reward.judge.template={REPO / 'prompt_templates' / 'digits_judge.jinja'}",
            f"worker.reward.judge.parse={REPO / 'reward_functions' / 'digits_judge.py'}:read_answer",
            "worker.reward.judge.sampling.temperature=0.0",
            "worker.reward.judge.sampling.max_tokens=12",
            steps=steps,
            val_every=val_every,
        )
    curves = {name: {int(r["step"]): round(r[key], 4) for r in rows if key in r} for name, key in CURVES.items()}
    train_rows = [r for r in rows if "reward/overall" in r]
    return {
        "run": f"judge={label}",
        "judge": str(judge_dir),
        "val": curves,
        "judge_requests": sum(r.get("judge/requests", 0.0) for r in train_rows),
        "judge_errors": sum(r.get("judge/errors", 0.0) + r.get("judge/parse_errors", 0.0) for r in train_rows),
        "server_start_s": round(serve_s, 1),
        "wall_s": round(wall, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--judge-steps", type=int, default=80, help="GRPO steps of the demo run that makes the judge")
    p.add_argument("--steps", type=int, default=40, help="steps of each run from the fresh student")
    p.add_argument("--val-every", type=int, default=10)
    p.add_argument(
        "--runs",
        nargs="+",
        default=["trained"],
        choices=("trained", "fresh", "grpo"),
        help="trained: the demo-trained judge; fresh: the student's own starting model as the judge; grpo: the "
        "demo as it is, on the dataset's rule (the reference curve)",
    )
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    for run in args.runs:
        if run == "grpo":
            rows, wall = bench_distill.train(
                args.workdir / f"grpo_run_{args.steps}", steps=args.steps, val_every=args.val_every
            )
            curve = {int(r["step"]): round(r["val/reward/overall"], 4) for r in rows if "val/reward/overall" in r}
            result: dict[str, Any] = {"run": "grpo_on_rule", "val": {"rule": curve}, "wall_s": round(wall, 1)}
        else:
            judge = (
                bench_distill.make_teacher(args.workdir, args.judge_steps)
                if run == "trained"
                else REPO / "assets" / "demo" / "model"
            )
            result = judged_run(args.workdir, judge, run, args.steps, args.val_every)
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
