"""On-policy distillation against GRPO on the digits demo: steps to reach the teacher's sampled validation reward.

1. Teacher: the demo run itself (`configs/demo.yaml`, GRPO, 80 steps), merged into a Hugging Face folder. Its
   sampled validation reward (`val/reward/mean@4` at its last step, 64 prompts x 4 samples at temperature 1) is the
   target.
2. From the same fresh student (`assets/demo/model`, the demo's starting point), with validation every
   `--val-every` steps: GRPO (the demo as it is), and distillation from the teacher with the task reward
   (`algorithm.distill.teacher.model_path=<teacher>`, k1, coef 1) and without it (`with_task_reward=false`).
3. Prints one JSON line per run (the validation curve, the first step at or above the target, wall seconds) and a
   summary line. Everything is seeded: a rerun on the same machine gives the same numbers.

    python scripts/bench_distill.py --workdir /tmp/distill   # about 10 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


REPO = Path(__file__).resolve().parent.parent
TARGET_KEY = "val/reward/mean@4"
RUNS = {"grpo": [], "distill+task": [], "distill_only": ["algorithm.distill.with_task_reward=false"]}
"""Each run's overrides beyond the learning rate (and, for the distillation runs, the teacher)."""


def train(run: Path, *overrides: str, steps: int, val_every: int) -> tuple[list[dict[str, Any]], float]:
    """`easyrl train configs/demo.yaml` with `overrides`; the logged rows and the wall seconds."""
    cmd = [
        sys.executable,
        "-m",
        "easyrl.cli",
        "train",
        str(REPO / "configs" / "demo.yaml"),
        "trainer.n_gpus_per_node=2",  # the layout of the figures recorded in docs/benchmarks.md (2 workers)
        f"trainer.max_steps={steps}",
        f"trainer.val_freq={val_every}",
        f"trainer.save_checkpoint_path={run}",
        "trainer.logger=[file]",
        "trainer.val_generations_to_log=0",
        *overrides,
    ]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    return [json.loads(line) for line in (run / "experiment_log.jsonl").read_text().splitlines()], wall


def make_teacher(workdir: Path, steps: int) -> Path:
    """Train the demo (GRPO, `configs/demo.yaml`) and merge its last checkpoint; made once per workdir."""
    out, run = workdir / "teacher", workdir / "teacher_run"
    if (out / "config.json").is_file():
        return out
    train(run, steps=steps, val_every=steps)
    merge = [sys.executable, "-m", "easyrl.cli", "merge", str(run / f"global_step_{steps}"), "--output", str(out)]
    subprocess.run([*merge, "--overwrite"] if out.exists() else merge, check=True, stdout=subprocess.DEVNULL)
    return out


def teacher_reward(workdir: Path, teacher: Path, reward: list[str]) -> float:
    """The teacher's sampled validation reward under the runs' reward settings (`trainer.val_only`: the same 64
    prompts x 4 samples, seeded alike, as every run's validation)."""
    label = "target_" + "_".join(r.rsplit(".", 1)[-1] for r in reward) if reward else "target"
    rows, _ = train(
        workdir / f"{label}_{teacher.name}",
        f"worker.actor.model.model_path={teacher}",
        "trainer.val_only=true",
        *reward,
        steps=1,
        val_every=1,
    )
    return float(rows[-1][TARGET_KEY])


def warm_start(workdir: Path, target_reward: float) -> Path:
    """A model from the demo asset script's supervised warm start, stopped as soon as its sampled reward reaches
    `target_reward` (no baked-in temperature). Low, it is a fresh student caught mid-way through learning the task
    (where the asset script notes that RL's weak signal does not finish the job in a few dozen steps); at 0.85, the
    script's own warm start. Made once per workdir."""
    out = workdir / f"warm_start{target_reward:g}"
    if (out / "model.safetensors").is_file():
        return out
    import random

    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO / "scripts"))
    import make_demo_assets as assets

    torch.set_num_threads(2)
    args = assets.parse_args(["--target-reward", str(target_reward), "--eval-every", "25"])
    tokenizer = assets.make_tokenizer()
    assets.build_model(out, arch="qwen2", seed=args.seed, tokenizer=tokenizer)
    model = AutoModelForCausalLM.from_pretrained(out)
    eval_rows = assets.make_rows(random.Random(args.seed + 2), 128)
    assets.warm_start(model, tokenizer, eval_rows, assets.load_reward(), args)
    assets.save_checkpoint(model, tokenizer, out)
    return out


def summarize(name: str, rows: list[dict[str, Any]], target: float, wall: float) -> dict[str, Any]:
    """The validation curve and the first step at or above the target (None: not reached)."""
    curve = {int(r["step"]): round(r[TARGET_KEY], 4) for r in rows if TARGET_KEY in r}
    reached = next((step for step, value in sorted(curve.items()) if value >= target), None)
    return {"run": name, "reached_at_step": reached, "val_mean@4": curve, "wall_s": round(wall, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--teacher-steps", type=int, default=80, help="GRPO steps of the demo that makes the teacher")
    p.add_argument("--steps", type=int, default=80, help="steps of each run from the fresh student")
    p.add_argument("--val-every", type=int, default=5)
    p.add_argument("--coef", type=float, default=1.0)
    p.add_argument("--mode", default="k1", choices=("k1", "k3", "topk_fkl"))
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-3], help="learning rates, each run at each")
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--ppo-epochs", type=int, default=1, help="worker.actor.ppo_epochs of every run")
    p.add_argument(
        "--exact-match",
        action="store_true",
        help="train and validate every run on the all-or-nothing reward (reward_functions/digits.py exact_match)",
    )
    p.add_argument(
        "--teacher-warm-start",
        type=float,
        default=None,
        help="the teacher is the asset script's warm start to this sampled reward, without the baked-in temperature "
        "(default: the demo run, GRPO for --teacher-steps)",
    )
    p.add_argument(
        "--student-warm-start",
        type=float,
        default=None,
        help="a fresh student from the asset script's warm start, stopped at this sampled reward (default: the "
        "demo's own starting model, assets/demo/model)",
    )
    args = p.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.teacher_warm_start is not None:
        teacher = warm_start(args.workdir, args.teacher_warm_start)
    else:
        teacher = make_teacher(args.workdir, args.teacher_steps)
    reward = ["worker.reward.reward_function_kwargs.exact_match=true"] if args.exact_match else []
    target = teacher_reward(args.workdir, teacher, reward)
    student = []
    if args.student_warm_start is not None:
        student = [f"worker.actor.model.model_path={warm_start(args.workdir, args.student_warm_start)}"]
    print(json.dumps({"teacher": str(teacher), "target": {TARGET_KEY: round(target, 4)}, "student": student}))
    distill = [
        f"algorithm.distill.teacher.model_path={teacher}",
        f"algorithm.distill.coef={args.coef}",
        f"algorithm.distill.mode={args.mode}",
        # topk_fkl's loss term runs on the unfused head (it is refused with the fused one)
        *(["worker.actor.fused_logprobs=false"] if args.mode == "topk_fkl" else []),
    ]
    results = []
    for lr in args.lrs:
        for name in args.runs:
            overrides = [
                f"worker.actor.optim.lr={lr}",
                f"worker.actor.ppo_epochs={args.ppo_epochs}",
                *student,
                *reward,
                *(distill if name != "grpo" else []),
                *RUNS[name],
            ]
            label = f"{name}@lr={lr:g}" + (f",{args.mode}x{args.coef:g}" if name != "grpo" else "")
            if args.student_warm_start is not None:
                label += f",student=warm{args.student_warm_start:g}"
            if args.exact_match:
                label += ",exact_match"
            if args.ppo_epochs != 1:
                label += f",epochs={args.ppo_epochs}"
            rows, wall = train(args.workdir / label, *overrides, steps=args.steps, val_every=args.val_every)
            results.append(summarize(label, rows, target, wall))
            print(json.dumps(results[-1]), flush=True)
    print(json.dumps({r["run"]: r["reached_at_step"] for r in results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
