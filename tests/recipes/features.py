"""The features that change what runs on the device, each on the tiny Qwen2.5 (or the tool demo's model) with its
own effect checked: what trained, what the engine received, what the feature logs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO, apply_edits, base_config
from tests.recipes.base import GAE, Context, Outcome, Recipe, expect, moved
from tests.recipes.families import digits_recipe_data, image_recipe_data, text_model, vl_model


def _qwen(ctx: Context) -> str:
    return text_model(ctx, "qwen2")


def _log(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "experiment_log.jsonl").read_text().splitlines()]


def lora(ctx: Context, sync: str) -> Outcome:
    edits = {
        "worker.actor.model.lora": {"rank": 4, "alpha": 8, "rollout_sync": sync},
        # the reference is the base under the adapters: the KL loss reads it
        "algorithm.disable_kl": False,
        "algorithm.use_kl_loss": True,
    }
    rows, before, after = ctx.train(_qwen(ctx), digits_recipe_data(ctx), edits, weights=True)
    # full_weights() is the merged policy: the adapted projections move, the embedding (no adapter) does not
    expect(moved(before, after, "self_attn.q_proj."), "the adapted projections did not move")
    expect(not moved(before, after, "embed_tokens."), "the embedding moved: it has no adapter")
    sent = rows[1].get("perf/weight_transfer_gb", 0.0) * 2**30
    assert before is not None
    full = sum(t.numel() * t.element_size() for t in before.values())
    if sync == "adapter":  # the engine gets the adapters only
        expect(0 < sent < full / 4, f"adapter sync pushed {sent:.0f} bytes, the merged model is {full}")
    pushed = f"; pushed {sent / 2**20:.2f} MiB of a {full / 2**20:.2f} MiB model" if sent else ""
    return Outcome(f"base frozen, adapters trained ({sync} sync){pushed}", rows)


def sleep_level(ctx: Context, level: int) -> Outcome:
    rows, _, _ = ctx.train(_qwen(ctx), digits_recipe_data(ctx), {"worker.rollout.sleep_level": level})
    freed = [r.get("perf/sleep_freed_gb", 0.0) for r in rows]
    if ctx.gpu:  # sleep mode is CUDA-only
        expect(all(f > 0 for f in freed), f"sleep level {level} freed {freed} GiB")
    return Outcome(f"sleep level {level} freed {max(freed):.3f} GiB a step; woke to the pushed weights", rows)


def offload(ctx: Context) -> Outcome:
    edits = {"worker.actor.offload": {"offload_params": True, "offload_optimizer": True}}
    rows, before, after = ctx.train(_qwen(ctx), digits_recipe_data(ctx), edits, weights=True)
    expect(moved(before, after, "self_attn.q_proj."), "no update after bringing the offloaded policy back")
    held = rows[1].get("perf/mem/actor/after_generate_gb")
    return Outcome(f"params and optimizer off the device while generating (device {held} GiB after generate)", rows)


def bypass(ctx: Context) -> Outcome:
    rows, _, _ = ctx.train(_qwen(ctx), digits_recipe_data(ctx), {"algorithm.rollout_correction.bypass_mode": True})
    expect(all("timing_s/old" not in r for r in rows), "bypass mode ran the old-log-prob pass")
    return Outcome("no old-log-prob pass: the engine's log-probs are the old ones", rows)


def tis(ctx: Context) -> Outcome:
    rows, _, _ = ctx.train(_qwen(ctx), digits_recipe_data(ctx), {"algorithm.tis_cap": 2.0})
    keys = sorted({k for r in rows for k in r if k.startswith("rollout_corr/")})
    expect(bool(keys), "tis_cap logged no rollout_corr/* metric")
    return Outcome(f"truncated IS weights applied ({len(keys)} rollout_corr metrics)", rows)


def ppo_critic(ctx: Context, lora: bool = False) -> Outcome:
    """PPO with a critic; `lora`: adapters on both the actor and the critic (whose value head trains whole)."""
    edits: dict[str, Any] = dict(GAE)
    if lora:
        edits |= {
            "worker.actor.model.lora": {"rank": 4, "alpha": 8},
            "worker.critic.model.lora": {"rank": 4, "alpha": 8},
        }
    rows, before, after = ctx.train(_qwen(ctx), digits_recipe_data(ctx), edits, weights=lora)
    losses = [r.get("critic/vf_loss") for r in rows]
    expect(all(v is not None for v in losses), f"critic/vf_loss {losses}")
    if lora:  # the merged policy: adapted projections move, the embedding (no adapter) does not
        expect(moved(before, after, "self_attn.q_proj."), "the actor's adapted projections did not move")
        expect(not moved(before, after, "embed_tokens."), "the embedding moved: it has no adapter")
    # what the critic's LoRA trains (adapters and its value head) is checked on CPU: tests/trainer/test_lora_e2e.py
    lora_note = " (LoRA on both; the actor's adapters moved)" if lora else ""
    return Outcome(f"critic trained{lora_note}: vf_loss {losses[0]:.4f} -> {losses[1]:.4f}", rows)


def dapo(ctx: Context) -> Outcome:
    edits = {"algorithm.online_filtering": True, "algorithm.filter_low": 0.0, "algorithm.filter_high": 1.0}
    rows, _, _ = ctx.train(_qwen(ctx), digits_recipe_data(ctx), edits)
    tries = [r.get("batch/num_gen_batches") for r in rows]
    expect(all(t is not None and t >= 1 for t in tries), f"batch/num_gen_batches {tries}")
    return Outcome(f"groups filtered, batch refilled ({tries} sampling tries)", rows)


def gspo(ctx: Context) -> Outcome:
    rows, _, _ = ctx.train(_qwen(ctx), digits_recipe_data(ctx), {"worker.actor.loss_type": "gspo"})
    expect(all("actor/pg_loss" in r for r in rows), "no actor/pg_loss")
    return Outcome("sequence-level ratio loss (gspo) trained", rows)


def distill(ctx: Context, mode: str) -> Outcome:
    from easyrl.testing.tiny import build_tiny_checkpoint

    teacher = ctx.built("teacher", lambda f: build_tiny_checkpoint(f, "qwen2", num_heads=2, num_kv_heads=1, seed=7))
    edits: dict[str, Any] = {"algorithm.distill": {"teacher": {"model_path": teacher}, "mode": mode}}
    if mode == "topk_fkl":
        edits["algorithm.distill"]["top_k"] = 4
        edits["worker.actor.fused_logprobs"] = False  # topk_fkl needs the student's logits at the teacher's ids
    rows, _, _ = ctx.train(_qwen(ctx), digits_recipe_data(ctx), edits)
    key = "actor/distill_topk_fkl" if mode == "topk_fkl" else "distill/reverse_kl"
    values = [r.get(key) for r in rows]
    expect(all(v is not None and v > 0 for v in values), f"{key} {values}: the teacher's signal is missing")
    return Outcome(f"teacher's signal {key} {values[0]:.3f} -> {values[1]:.3f}", rows)


def multi_turn_tools(ctx: Context) -> Outcome:
    """The tool demo (configs/demo_tools.yaml: its model, environment and reward) for 2 steps."""
    conf = yaml.safe_load((REPO / "configs" / "demo_tools.yaml").read_text())
    rows = _train_yaml(ctx, conf, {})
    rates = [r["multi_turn/tool_call_rate"] for r in rows]
    observed = [r["multi_turn/observation_tokens_mean"] for r in rows]
    expect(all(r > 0 for r in rates) and all(o > 0 for o in observed), f"tool calls {rates}, observations {observed}")
    return Outcome(f"tool-call rate {rates[0]:.2f}, {rates[1]:.2f}; observation tokens appended", rows)


def judge(ctx: Context) -> Outcome:
    """A local judge served by easyrl for the run, on the trainer's GPU (`server.num_gpus: 0`)."""
    conf = base_config(_qwen(ctx), digits_recipe_data(ctx), ctx.work / "run")
    server_args = ["--max-model-len", "512", "--enforce-eager"]
    if ctx.gpu:
        server_args += ["--gpu-memory-utilization", "0.05", "--kv-cache-memory-bytes", str(256 << 20)]
    else:
        server_args += ["--dtype", "float32"]
    conf["worker"]["reward"] |= {
        "reward_function": str(REPO / "reward_functions" / "judge.py") + ":compute_score",
        "num_workers": 1,
        "judge": {
            "model": {"model_path": _qwen(ctx), "name": "recipe-judge"},
            "server": {"num_gpus": 0, "args": server_args},
            "template": str(REPO / "tests" / "assets" / "judge.jinja"),
            "parse": str(REPO / "tests" / "assets" / "judge_parse.py") + ":length_score",
            "sampling": {"max_tokens": 8},
        },
    }
    rows = _train_yaml(ctx, conf, {})
    asked = [r.get("recipe-judge/requests") for r in rows]
    failed = [r.get("recipe-judge/errors") for r in rows]
    expect(all(a and a > 0 for a in asked) and failed == [0, 0], f"judge requests {asked}, errors {failed}")
    return Outcome(f"judge served beside the trainer answered {sum(a or 0 for a in asked):.0f} requests", rows)


def async_staleness(ctx: Context) -> Outcome:
    edits = {
        "trainer.max_staleness": 1,
        "data.max_response_length": 16,
        "worker.rollout.chunk_tokens": 2,
        "worker.rollout.stop_token_ids": list(range(100, 160)),
    }
    # 4 steps: at S = 1, step k may train what version k - 2 sampled, and step 1's early-finishing groups may all
    # score alike (no gradient): step 4 trains what versions >= 2 sampled, after two updates
    rows, _, _ = ctx.train(_qwen(ctx), digits_recipe_data(ctx), edits, steps=4)
    worst = max(r.get("async/staleness_max", 0.0) for r in rows)
    expect(worst <= 1, f"a trained token {worst} versions old with max_staleness 1")
    carried = [r.get("async/groups_carried", 0.0) for r in rows]
    return Outcome(f"carry-over at S=1: staleness max {worst:.0f}, groups carried {carried}", rows, staleness=1)


def async_vl(ctx: Context) -> Outcome:
    """Carry-over with image prompts: a response cut at a chunk resumes in the next engine call with its prompt's
    media (the HF engine: the processed pixels; vLLM: its raw prompt with the tokens so far appended, expanded again
    by its processor), and the vision tower learns from the pixels."""

    data, vl = image_recipe_data(ctx)
    # stop tokens end responses at different lengths, so some are cut at a step's end and resume in the next
    edits = vl | {
        "trainer.max_staleness": 1,
        "data.max_response_length": 16,
        "worker.rollout.chunk_tokens": 2,
        "worker.rollout.stop_token_ids": list(range(100, 160)),
    }
    # 4 steps, as async_staleness_1: the last trains what versions >= 2 sampled
    rows, before, after = ctx.train(vl_model(ctx, "qwen2_5_vl"), data, edits, steps=4, weights=True)
    worst = max(r.get("async/staleness_max", 0.0) for r in rows)
    expect(worst <= 1, f"a trained token {worst} versions old with max_staleness 1")
    resumed = max(r.get("async/resumed_fraction", 0.0) for r in rows)
    expect(resumed > 0, "no response resumed in a later engine call: the continuation with media never ran")
    expect(moved(before, after, "visual."), "the vision tower got no gradient: the continued calls lost the pixels?")
    return Outcome(
        f"carry-over with images at S=1: staleness max {worst:.0f}, resumed {resumed:.2f}", rows, staleness=1
    )


def inline_engine_healing(ctx: Context) -> Outcome:
    """One worker per role in the driver's process (`trainer.backend: inline`, the HF engine: vLLM runs on Ray) whose
    engine is killed in step 2's generate (`EASYRL_ENGINE_FAULT=kill@2`): rebuilt with the current weights, the call
    re-sent, the step finished (issues 45 item 8 and 46). On a GPU: inline's device set-up and the HF engine's
    rebuild on CUDA, neither run on one before."""
    from easyrl.rollout.faults import FAULT_ENV, reset_fault_count

    os.environ[FAULT_ENV] = "kill@2"  # inline, the engine is in this process: it reads this process's environment
    reset_fault_count()
    try:
        edits = {"trainer.backend": "inline", "trainer.n_gpus_per_node": 1}
        rows, _, _ = ctx.train(_qwen(ctx), digits_recipe_data(ctx), edits, engine="hf")
    finally:
        os.environ.pop(FAULT_ENV, None)
        reset_fault_count()
    restarts = [r.get("rollout/engine_restarts", 0.0) for r in rows]
    expect(restarts == [0.0, 1.0], f"engine restarts per step {restarts}, expected [0, 1]")
    return Outcome("inline, HF engine killed in step 2: rebuilt with the current weights, the step finished", rows)


def sft(ctx: Context) -> Outcome:
    from tests.trainer.test_sft_e2e import _train

    data = Path(ctx.built("sft_data", _sft_data))
    edits = {"trainer.max_steps": 2, "trainer.n_gpus_per_node": 1, "trainer.device": "cuda" if ctx.gpu else "cpu"}
    files = {"train": str(data / "train.jsonl"), "val": str(data / "val.jsonl")}
    logged, before, after = _train(ctx.work, _qwen(ctx), files, edits)  # `easyrl sft`'s trainer, as its tests run it
    losses = [r["train/loss"] for r in logged if "train/loss" in r]
    expect(len(losses) == 2 and all(v == v and v < 1e4 for v in losses), f"train/loss {losses}")
    expect(moved(before, after, "self_attn.q_proj."), "SFT moved no weight")
    return Outcome(f"easyrl sft: loss {losses[0]:.3f} -> {losses[1]:.3f}, weights moved")


def _sft_data(folder: Path) -> str:
    import random

    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    tasks = [" ".join(str(rng.randrange(10)) for _ in range(4)) for _ in range(48)]
    train = [{"messages": [{"role": "user", "content": "Copy: " + t}, {"role": "assistant", "content": t.replace(" ", "")}]} for t in tasks]  # fmt: skip
    val = [{"prompt": "Copy: " + t, "response": t.replace(" ", "")} for t in tasks[:6]]
    for name, rows in (("train", train), ("val", val)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder)


def kill_and_resume(ctx: Context) -> Outcome:
    """`easyrl train` killed with SIGKILL (its whole process group) once step 1's checkpoint is committed; the same
    command resumes from it and trains step 2."""
    conf = apply_edits(base_config(_qwen(ctx), digits_recipe_data(ctx), ctx.work / "run"), ctx.edits())
    apply_edits(conf, {"trainer.max_steps": 2, "trainer.save_freq": 1})
    path = ctx.work / "train.yaml"
    path.write_text(yaml.safe_dump(conf))
    cmd = [sys.executable, "-m", "easyrl.cli", "train", str(path)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = (ctx.work / "train.log").open("ab")
    tracker = ctx.work / "run" / "latest_checkpointed_iteration.txt"
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        while not (tracker.exists() and tracker.read_text().strip() == "1"):
            expect(proc.poll() is None, f"`easyrl train` ended (exit {proc.returncode}) before step 1's checkpoint")
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    done = subprocess.run(cmd, env=env, stdout=log, stderr=log, timeout=600, check=False)
    expect(
        done.returncode == 0, f"the resumed `easyrl train` exited {done.returncode} (log: {ctx.work / 'train.log'})"
    )
    steps = [r["step"] for r in _log(ctx.work / "run") if "actor/pg_loss" in r]
    expect(steps.count(1) == 1 and steps[-1] == 2, f"logged steps {steps}: not resumed from step 1")
    rows = {r["step"]: r for r in _log(ctx.work / "run") if "actor/pg_loss" in r}
    return Outcome("killed after step 1's checkpoint; resumed and trained step 2", [rows[1], rows[2]])


def _train_yaml(ctx: Context, conf: dict[str, Any], edits: dict[str, Any]) -> list[dict[str, Any]]:
    """2 steps of the config `conf` with the device's settings and `edits`, in this process; the logged steps."""
    from easyrl.config import load_config_and_secrets
    from easyrl.trainer.trainer import Trainer

    run_dir = ctx.work / "run"
    run = {"trainer.max_steps": 2, "trainer.logger": ["file"], "trainer.save_checkpoint_path": str(run_dir),
           "trainer.val_before_train": False, "trainer.val_freq": -1}  # fmt: skip
    apply_edits(conf, ctx.edits() | run | edits)
    path = ctx.work / "train.yaml"
    path.write_text(yaml.safe_dump(conf))
    trainer = Trainer(*load_config_and_secrets(path))
    try:
        trainer.fit()
    finally:
        trainer.close()
    return [r for r in _log(run_dir) if "actor/pg_loss" in r]


def long_video(ctx: Context) -> Outcome:
    """Issue 47: the last-colour task's 1,000-frame videos, decoded streaming and sampled to 8 frames (the last one
    among them), through the engine and the update on the task's tiny Qwen2.5-VL."""
    from easyrl.testing.long_video import DATA, build_last_colour_task

    def build(folder: Path) -> str:
        # head size 32 in the language model and the vision tower (vLLM's kernels reject 16)
        build_last_colour_task(folder, train=8, val=1, num_heads=2, num_kv_heads=1, vision_hidden_size=64)
        return str(folder)

    folder = Path(ctx.built("last_colour", build))
    edits = {f"data.{k}": v for k, v in DATA.items()} | {
        "data.video_dir": str(folder / "videos"),
        "data.format_prompt": None,
        "data.max_response_length": 2,
        "worker.reward.reward_function": str(REPO / "reward_functions" / "last_colour.py:compute_score"),
    }
    rows, before, after = ctx.train(str(folder / "model"), {"train": str(folder / "train.jsonl")}, edits,
                                    weights=True)  # fmt: skip
    expect(moved(before, after, "language_model."), "the language model did not move")
    prompt = rows[0]["prompt_length/mean"]
    # 8 frames of 32x32: 4 temporal patches of 4 merged tokens, plus the question and the chat template
    expect(prompt >= 16 + 10, f"prompts of {prompt:.0f} tokens: the 16 video tokens were not expanded")
    reward = [r["reward/overall"] for r in rows]
    return Outcome(f"1,000-frame videos sampled to 8 frames; prompts {prompt:.0f} tokens; reward {reward}", rows)


def diffusion_tiny(ctx: Context) -> Outcome:
    """Issue 48: Flow-GRPO on the shipped tiny SD3-style pipeline (assets/demo_diffusion): the `diffusers` engine hosted
    in the denoiser actor samples 4 SDE steps per image, the brightness reward scores the decoded images, the update
    moves the denoiser. On a GPU: the engine, the guided forward and FSDP2 on a diffusers transformer on CUDA."""
    demo = REPO / "assets" / "demo_diffusion"
    edits = {
        "worker.rollout.name": "diffusers",
        "worker.rollout.diffusion.num_steps": 4,
        "worker.rollout.diffusion.guidance_scale": 1.0,
        "worker.rollout.diffusion.height": 32,
        "worker.rollout.diffusion.width": 32,
        "worker.rollout.diffusion.max_sequence_length": 8,
        "worker.rollout.logprob_sample_ratio": None,
        "algorithm.disable_kl": True,
        "data.prompt_key": "prompt",
        "data.answer_key": "answer",
        "data.format_prompt": None,
        "worker.reward.reward_function": str(REPO / "reward_functions" / "colour.py:brightness"),
    }
    rows, before, after = ctx.train(str(demo / "pipeline"), {"train": str(demo / "train.jsonl")}, edits, weights=True)
    expect(moved(before, after, ""), "the denoiser did not move")
    reward = [round(r["reward/overall"], 3) for r in rows]
    expect(all(0.0 <= x <= 1.0 for x in reward), f"brightness outside [0, 1]: {reward}")
    return Outcome(f"tiny SD3 pipeline, 4 SDE steps, 32x32 images; brightness {reward}", rows)


def liger_kernels(ctx: Context) -> Outcome:
    """Liger's Triton RMSNorm / SwiGLU / RoPE in the actor (`worker.actor.model.liger_kernels`) against vLLM's own
    kernels: the numerics gate (`check_rl`) is the proof that the switch keeps the log-probs within bf16 noise."""
    rows, before, after = ctx.train(_qwen(ctx), digits_recipe_data(ctx), {"worker.actor.model.liger_kernels": True},
                                    weights=True)  # fmt: skip
    expect(moved(before, after, "mlp."), "the MLPs (Liger's SwiGLU) did not move")
    errors = [round(float(r["rollout/token_prob_error"]), 4) for r in rows]
    return Outcome(f"Liger RMSNorm/SwiGLU/RoPE in the actor; token_prob_error {errors} against vLLM", rows)


def fused_head_triton(ctx: Context) -> Outcome:
    """The fused log-prob head on easyrl's Triton kernels (`worker.actor.fused_head_kernel: triton`) in the update
    and the old/reference passes: the numerics gate (`check_rl`) holds the log-probs to vLLM's within bf16 noise,
    and the embedding (the tied head, whose gradient the kernel writes) moves."""
    edits = {"worker.actor.fused_logprobs": True, "worker.actor.fused_head_kernel": "triton"}
    rows, before, after = ctx.train(_qwen(ctx), digits_recipe_data(ctx), edits, weights=True)
    expect(moved(before, after, "embed_tokens"), "the embedding (tied head) did not move")
    errors = [round(float(r["rollout/token_prob_error"]), 4) for r in rows]
    return Outcome(f"Triton fused head; token_prob_error {errors} against vLLM", rows)


def compile_layers(ctx: Context) -> Outcome:
    """`torch.compile` per decoder layer in the actor (`worker.actor.model.compile_layers`) and its old-log-prob pass,
    padding-free with gradient checkpointing, against vLLM's own kernels: the numerics gate (`check_rl`) is the proof
    that inductor's fused layers keep the log-probs within bf16 noise; the weights sync to vLLM by their names."""
    edits = {"worker.actor.model.compile_layers": True, "worker.actor.model.enable_gradient_checkpointing": True}
    rows, before, after = ctx.train(_qwen(ctx), digits_recipe_data(ctx), edits, weights=True)
    expect(moved(before, after, "mlp."), "the MLPs (compiled layers) did not move")
    expect(not any("_orig_mod" in name for name in after or {}), "compiled names leaked into the weights")
    errors = [round(float(r["rollout/token_prob_error"]), 4) for r in rows]
    return Outcome(f"torch.compile per decoder layer in the actor; token_prob_error {errors} against vLLM", rows)


def gpu_tests(ctx: Context, path: str) -> Outcome:
    """The `gpu`-marked tests of `path` in one pytest process, as a recipe: the matrix is what a lent GPU runs first,
    and these have never run on one. Passes when pytest does with at least one test passed (a setting that needs more
    GPUs than the machine has is skipped and says so); the tests' own lines with "measured" are the effect."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-rfEs", "-p", "no:cacheprovider", "-m", "gpu", path]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)  # bounded by the recipe's limit
    lines = (proc.stdout + proc.stderr).splitlines()
    summary = next((x for x in reversed(lines) if re.search(r"\b(passed|failed|skipped|error)", x)), "no summary")
    expect(proc.returncode == 0 and "passed" in summary, f"{path}: {summary}\n" + "\n".join(lines[-40:]))
    figures = [x.strip() for x in lines if "measured" in x]
    return Outcome(f"{path}: {summary.strip('= ')}" + "".join(f"; {f}" for f in figures))


def _feature(name: str, run: Any, limit_s: float = 40.0, cpu: bool = True) -> Recipe:
    return Recipe(name, "feature", run, limit_s, cpu)


FEATURES = (
    _feature("lora_merged", partial(lora, sync="merged")),
    # vLLM's LoRA support, sleep mode and offloading exist on CUDA only: no CPU form to run
    _feature("lora_adapter", partial(lora, sync="adapter"), cpu=False),
    _feature("sleep_level_1", partial(sleep_level, level=1), cpu=False),
    _feature("sleep_level_2", partial(sleep_level, level=2), cpu=False),
    _feature("offload", offload, cpu=False),
    _feature("bypass_mode", bypass),
    _feature("tis", tis),
    _feature("ppo_critic", ppo_critic, limit_s=50),
    _feature("ppo_critic_lora", partial(ppo_critic, lora=True), limit_s=50),
    _feature("dapo_filtering", dapo),
    _feature("gspo", gspo),
    _feature("multi_turn_tools", multi_turn_tools, limit_s=50),
    _feature("judge_same_gpu", judge, limit_s=90, cpu=False),  # its CPU form is tests/scorers/test_local_judge.py
    _feature("teacher_k1", partial(distill, mode="k1"), limit_s=50),
    _feature("teacher_topk_fkl", partial(distill, mode="topk_fkl"), limit_s=50),
    _feature("sft", sft),
    _feature("async_staleness_1", async_staleness, limit_s=50),
    _feature("async_vl_image", async_vl, limit_s=60),
    _feature("kill9_resume", kill_and_resume, limit_s=120),
    _feature("inline_engine_healing", inline_engine_healing, limit_s=60),
    _feature("long_video", long_video, limit_s=60),
    _feature("diffusion_tiny", diffusion_tiny, limit_s=60),
    _feature("liger_kernels", liger_kernels, cpu=False),  # Triton: CUDA only (refused on CPU)
    _feature("fused_head_triton", fused_head_triton, cpu=False),  # Triton: CUDA only (refused on CPU)
    # its CPU form is tests/models/test_compiled_layers.py (a CPU compile costs ~30 s a process: over this budget)
    _feature("compile_layers", compile_layers, limit_s=90, cpu=False),
    # issue 44 item 5: the update's measured peak against the plan at each lever setting (3 runs of a 0.5B on one GPU)
    _feature("memory_within_plan", partial(gpu_tests, path="tests/workers/test_memory_plan_gpu.py"), 150, cpu=False),
    # issue 47: vLLM generating from the actor's held Qwen2.5-VL image and video embeddings
    _feature("vllm_held_embeds", partial(gpu_tests, path="tests/rollout/test_engine_embeds.py"), 75, cpu=False),
)
