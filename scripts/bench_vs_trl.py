"""Side by side on one machine: the easyrl CPU demo against TRL's `GRPOTrainer` doing the same training.

Both sides train the demo model (`assets/demo/model`, made by `scripts/make_demo_assets.py`) on the demo prompts
(`assets/demo/train.jsonl`, rendered with `prompt_templates/digits.jinja`, which is the prompt itself, then the
model's chat template) with the demo reward (`reward_functions/digits.py`, the `overall` score), GRPO with the shape
and hyper-parameters of `configs/demo.yaml`: 16 prompts x 8 samples per step, one AdamW step per rollout batch
(lr 1e-3, betas 0.9/0.999, no weight decay, constant LR, grad-norm clip 1.0), PPO clip 0.2 / 0.28, no KL,
token-mean loss over the whole batch (TRL's `dapo`), advantages divided by the group's std, temperature 1.0, no
top-k/top-p, at most 12 response tokens, fp32, no gradient checkpointing, validation off, a full checkpoint (model
and optimizer) at the last step. easyrl runs as `configs/demo.yaml` does: one worker with every core, inside the
`easyrl` process (`trainer.backend: auto` picks inline); TRL runs in one process (torch's default threads: all cores). Runs alternate tool by tool for each seed, so drifting machine load hits both.

Measured for every run, from the launching process: whole-command wall time; start to the end of step 1 (the
moment the step's line reaches stdout); seconds per step after `--warmup` steps; last step to process exit; peak RSS
and peak PSS summed over the process tree (psutil: RSS every `--sample-s`, PSS every `--pss-s`; RSS counts a shared
library once per process, PSS shares it out) and the most processes seen at once; the sampler's own CPU seconds
(reading PSS of easyrl's 9 processes every 0.1 s slowed its steps from 0.201 to 0.231 s on 2026-11-26: PSS is now
read once a second); the mean training reward of the first and of the last 5 steps.

TRL lives in its own virtual environment (it may pin another transformers than easyrl's); create it once with

    python3 -m venv /work/trl-venv
    /work/trl-venv/bin/pip install torch==2.13.0      # the CPU build from local disk, never a CUDA one
    /work/trl-venv/bin/pip install trl==1.16.0

Usage (from the repository root, in easyrl's environment):

    python scripts/bench_vs_trl.py --trl-python /work/trl-venv/bin/python [--seeds 1 2] [--steps 80]

`python scripts/bench_vs_trl.py trl-run ...` is the TRL side itself, run by the TRL interpreter; it imports nothing
of easyrl.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from typing import Any


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_LINE = re.compile(r"^step (\d+): .*?\boverall=([-+0-9.eE]+|nan)")


# ---------------------------------------------------------------------------------------------- the TRL side
def trl_run(seed: int, steps: int, out: str) -> None:
    """GRPO with TRL on the demo task, configured as `configs/demo.yaml` (see the module docstring)."""
    import importlib.util

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = importlib.util.spec_from_file_location("digits", os.path.join(ROOT, "reward_functions", "digits.py"))
    assert spec is not None and spec.loader is not None
    digits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digits)

    def overall(completions: list[list[dict[str, str]]], answer: list[str], **_: Any) -> list[float]:
        return [digits.score_one(c[0]["content"], a)["overall"] for c, a in zip(completions, answer)]

    with open(os.path.join(ROOT, "assets", "demo", "train.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    # digits.jinja renders the prompt unchanged; the chat template comes from the model's tokenizer, as in easyrl.
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    )
    model_dir = os.path.join(ROOT, "assets", "demo", "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    class StepLines(TrainerCallback):  # the same "step N: overall=R" line easyrl's console logger prints
        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **_: Any) -> None:
            if logs and "reward" in logs:
                print(f"step {state.global_step}: overall={logs['reward']:.4g}", flush=True)

    config = GRPOConfig(
        output_dir=out,
        use_cpu=True,
        bf16=False,
        seed=seed,
        data_seed=seed,
        max_steps=steps,
        per_device_train_batch_size=128,  # 16 prompts x 8 samples, one optimizer step per rollout batch
        gradient_accumulation_steps=1,
        num_generations=8,
        max_completion_length=12,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        optim="adamw_torch",
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="steps",
        save_steps=steps,
        report_to=[],
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=overall,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[StepLines()],
    )
    trainer.train()


# ---------------------------------------------------------------------------------------------- measuring
def _tree_memory(pid: int, with_pss: bool = True) -> tuple[float, float, int]:
    """(MiB resident summed over `pid` and its descendants, the same in PSS, number of processes). RSS counts a
    shared page (torch's libraries, mapped by every process that imports it) once per process; PSS splits it among
    them, so the PSS sum is what the tree takes from the machine."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0, 0.0, 0
    rss, pss, count = 0, 0, 0
    for proc in procs:
        try:
            # smaps_rollup (PSS) walks every mapping of a torch process: ~10 ms each, so it is read less often
            info = proc.memory_full_info() if with_pss else proc.memory_info()
            rss += info.rss
            pss += getattr(info, "pss", 0)
            count += 1
        except psutil.Error:
            continue
    return rss / 2**20, pss / 2**20, count


def measure(
    cmd: list[str], cwd: str, env: dict[str, str], log_path: str, sample_s: float, pss_s: float
) -> dict[str, Any]:
    """Run `cmd`, timestamp its step lines and sample its process tree's memory until it exits: RSS every
    `sample_s`, PSS every `pss_s` (the sampler's own CPU time is returned: on two cores it slows the run measured)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    peak = {"rss_mib": 0.0, "pss_mib": 0.0, "procs": 0, "sampler_cpu_s": 0.0}
    done = threading.Event()

    def sample() -> None:
        next_pss = 0.0
        while not done.is_set():
            with_pss = time.monotonic() >= next_pss
            if with_pss:
                next_pss = time.monotonic() + pss_s
            rss, pss, count = _tree_memory(proc.pid, with_pss)
            peak["rss_mib"] = max(peak["rss_mib"], rss)
            peak["pss_mib"] = max(peak["pss_mib"], pss)
            peak["procs"] = max(peak["procs"], count)
            peak["sampler_cpu_s"] = time.thread_time()
            done.wait(sample_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    steps: dict[int, tuple[float, float]] = {}  # step -> (seconds since start, reward)
    assert proc.stdout is not None
    with open(log_path, "w", encoding="utf-8") as log:
        for line in proc.stdout:
            now = time.monotonic() - start
            log.write(f"{now:8.3f} {line}")
            match = STEP_LINE.match(line.strip())
            if match:
                steps[int(match.group(1))] = (now, float(match.group(2)))
    rc = proc.wait()
    end = time.monotonic() - start
    done.set()
    sampler.join()
    return {"rc": rc, "wall_s": end, "steps": steps, **peak}


def summarize(run: dict[str, Any], warmup: int) -> dict[str, Any]:
    steps = run["steps"]
    if not steps:
        return {"rc": run["rc"], "wall_s": run["wall_s"], "error": "no step line"}
    order = sorted(steps)
    first, last = order[0], order[-1]
    rewards = [steps[s][1] for s in order]
    after = [s for s in order if s >= warmup]
    per_step = (steps[after[-1]][0] - steps[after[0]][0]) / (after[-1] - after[0]) if len(after) > 1 else float("nan")
    return {
        "rc": run["rc"],
        "wall_s": round(run["wall_s"], 2),
        "to_step1_s": round(steps[first][0], 2),
        "s_per_step": round(per_step, 3),
        "last_step_to_exit_s": round(run["wall_s"] - steps[last][0], 2),
        "peak_rss_mib": round(run["rss_mib"]),
        "peak_pss_mib": round(run["pss_mib"]),
        "max_procs": run["procs"],
        "sampler_cpu_s": round(run["sampler_cpu_s"], 2),
        "steps": len(order),
        "reward_first5": round(statistics.fmean(rewards[:5]), 3),
        "reward_last5": round(statistics.fmean(rewards[-5:]), 3),
    }


def easyrl_cmd(seed: int, steps: int, run_dir: str, overrides: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "easyrl.cli",
        "train",
        "configs/demo.yaml",
        f"data.seed={seed}",
        f"trainer.seed={seed}",
        f"worker.rollout.seed={seed}",
        f"trainer.max_steps={steps}",
        "trainer.val_freq=-1",
        "trainer.val_before_train=false",
        f"trainer.save_checkpoint_path={run_dir}",
        *overrides,
    ]


def main(argv: list[str]) -> int:
    if argv[:1] == ["trl-run"]:
        parser = argparse.ArgumentParser(prog="bench_vs_trl.py trl-run")
        parser.add_argument("--seed", type=int, required=True)
        parser.add_argument("--steps", type=int, required=True)
        parser.add_argument("--out", required=True)
        args = parser.parse_args(argv[1:])
        trl_run(args.seed, args.steps, args.out)
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-python", help="the TRL venv's python (see above); without it only easyrl runs")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of s/step")
    parser.add_argument("--sample-s", type=float, default=0.1, help="process-tree RSS sampling period")
    parser.add_argument(
        "--pss-s", type=float, default=1.0, help="process-tree PSS sampling period (each read costs ~10 ms a process)"
    )
    parser.add_argument(
        "--set", nargs="*", default=[], help="easyrl config overrides (key=value) for both easyrl runs"
    )
    parser.add_argument("--only", choices=("easyrl", "trl"), help="run one side only")
    parser.add_argument(
        "--baseline-root", help="another easyrl checkout (e.g. `git worktree add /tmp/base main`) run as easyrl-base"
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "checkpoints", "bench_vs_trl"))
    args = parser.parse_args(argv)
    roots = {"easyrl": ROOT, "easyrl-base": os.path.abspath(args.baseline_root or "")}
    tools = ["easyrl", *(["easyrl-base"] if args.baseline_root else []), *(["trl"] if args.trl_python else [])]
    tools = [t for t in tools if args.only in (None, t.split("-")[0])]
    os.makedirs(args.out, exist_ok=True)
    results: list[dict[str, Any]] = []
    for seed in args.seeds:
        for tool in tools:
            run_dir = os.path.join(args.out, f"{tool}-seed{seed}")
            shutil.rmtree(run_dir, ignore_errors=True)  # easyrl would resume from an old checkpoint there
            root = roots.get(tool, ROOT)
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": root}
            if tool.startswith("easyrl"):
                cmd = easyrl_cmd(seed, args.steps, run_dir, args.set)
            else:
                cmd = [
                    args.trl_python,
                    os.path.abspath(__file__),
                    "trl-run",
                    f"--seed={seed}",
                    f"--steps={args.steps}",
                ]
                cmd.append(f"--out={run_dir}")
            load = os.getloadavg()[0]
            row = {"tool": tool, "seed": seed, "load1_before": round(load, 2)}
            row |= summarize(measure(cmd, root, env, run_dir + ".log", args.sample_s, args.pss_s), args.warmup)
            print(json.dumps(row), flush=True)
            results.append(row)
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    keys = (
        "wall_s",
        "to_step1_s",
        "s_per_step",
        "last_step_to_exit_s",
        "peak_rss_mib",
        "peak_pss_mib",
        "reward_first5",
        "reward_last5",
    )
    print("median        " + " ".join(f"{k:>20}" for k in keys))
    for tool in tools:
        rows = [r for r in results if r["tool"] == tool and "error" not in r]
        if rows:
            print(f"{tool:<14}" + " ".join(f"{statistics.median(r[k] for r in rows):>20g}" for k in keys))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
