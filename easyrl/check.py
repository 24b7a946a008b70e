"""`easyrl check`: everything that can be checked without a GPU and without training, then the plan."""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from easyrl.config import EasyRLConfig
from easyrl.config.algorithm import KLMode
from easyrl.config.diffusion_run import is_diffusion_run
from easyrl.config.worker import ActorConfig, LoraConfig
from easyrl.models.family import unlisted_family_warning
from easyrl.trainer.plan import RunPlan, effective_reuse_first_forward, plan_of
from easyrl.trainer.role_specs import cpu_threads
from easyrl.trainer.step_math import OldPass
from easyrl.workers.varlen import attention_kernel


if TYPE_CHECKING:
    from easyrl.rollout.engine import EngineCheck


def plan_lines(cfg: EasyRLConfig) -> list[str]:
    """What will run: algorithm, engines, workers and the batch arithmetic."""
    alg, w, d, t = cfg.algorithm, cfg.worker, cfg.data, cfg.trainer
    plan = plan_of(cfg)
    workers, separate = plan.world_size, plan.separate
    samples = d.rollout_batch_size * w.rollout.n
    updates = d.rollout_batch_size // w.actor.global_batch_size
    dp = plan.data_parallel_size
    per_worker = w.actor.global_batch_size * w.rollout.n // dp
    sp = f"; sequence parallel {_sp_layout(w.actor)} ({dp} data-parallel groups)" if w.actor.sp_size > 1 else ""
    tp = plan.ranks_per_engine
    engines = f"{plan.rollout_engines} (tensor parallel {tp})" if tp > 1 else str(plan.rollout_workers)
    where = (
        f", on {w.rollout.n_gpus} rollout worker(s) of their own (resident, weights pushed after each update)"
        if separate
        else ", in the actor's processes (asleep while it trains)"
    )
    if alg.kl_mode == KLMode.OFF:
        kl = "off (no reference model)"
    else:
        where = "in the loss" if alg.kl_mode == KLMode.IN_LOSS else f"in the reward ({alg.kl_type})"
        kl = f"{alg.kl_penalty} x {alg.kl_coef} {where}"
    lora = w.actor.model.lora
    adapters = _adapters(lora)
    ref = "" if alg.kl_mode == KLMode.OFF else ", ref (the actor with its adapters off)" if lora.rank else ", ref"
    dist = alg.distill
    task = f"{alg.adv_estimator} advantages" if not dist.enabled or dist.with_task_reward else "no task advantage"
    return [
        f"algorithm: {task}, {w.actor.loss_type} policy loss ({w.actor.loss_avg_mode}), KL {kl}"
        + (", online filtering" if alg.online_filtering else "")
        + (
            f", distillation from {dist.teacher.model_path or dist.teacher.base_url} ({dist.mode} x {dist.coef})"
            if dist.enabled
            else ""
        ),
        f"model: {w.actor.model.model_path}{adapters}",
        f"attention (training, on this machine): {attention_kernel(plan.padding_free)}",
        f"rollout: {engines} {w.rollout.name} engine(s), n={w.rollout.n}, temperature={w.rollout.temperature}, "
        f"top_p={w.rollout.top_p}, top_k={w.rollout.top_k}, max {d.max_response_length} new tokens{where}",
        f"workers: {t.nnodes} node(s) x {t.n_gpus_per_node} = {workers} per role; roles: actor"
        + ("" if separate else "+rollout")
        + ref
        + (", critic" + _adapters(w.critic.model.lora) if plan.critic else "")
        + (", teacher" if plan.teacher_worker else "")
        + sp
        + ("" if plan.use_gpu else f"; {cpu_threads(cfg, plan)} torch thread(s) each"),
        backend_line(plan),
        f"batch: {d.rollout_batch_size} prompts x {w.rollout.n} = {samples} samples per step; {updates} optimizer "
        f"step(s) of {w.actor.global_batch_size} prompts; {per_worker} samples per worker per optimizer step in "
        + (
            f"micro-batches of up to {w.actor.max_token_len_per_gpu} tokens per worker"
            if w.actor.dynamic_batching
            else f"micro-batches of {w.actor.micro_batch_size_per_device_for_update}"
        ),
        "old log-probs: " + old_log_probs_line(cfg, plan),
        *async_lines(cfg, plan),
        validation_line(cfg),
        f"reward: {w.reward.reward_function} ({w.reward.num_workers} processes, {w.reward.timeout_s:g} s timeout)",
        f"output: {t.save_checkpoint_path}",
    ]


def backend_line(plan: RunPlan) -> str:
    """What runs the workers and why (`trainer.backend`; `auto` decided by the plan)."""
    where = "Ray worker processes" if plan.backend.value == "ray" else "this process (no Ray)"
    return f"backend: {plan.backend.value}, workers in {where} ({plan.backend_reason})"


def async_lines(cfg: EasyRLConfig, plan: RunPlan) -> list[str]:
    """With `trainer.max_staleness` >= 1: the carry-over loop's settings, and whether the loss sees the staleness."""
    staleness, rollout, per_step = plan.staleness, cfg.worker.rollout, cfg.data.rollout_batch_size
    if plan.schedule == "synchronous":
        return []
    corr = cfg.algorithm.correction
    seen = (
        "the loss corrects for it (algorithm.rollout_correction)"
        if corr.reads_rollout_log_probs
        else "the loss does not see it: rollout_correction.rollout_is: token or bypass_mode: true corrects for it"
    )
    return [
        f"asynchronous: a trained token is at most {staleness} policy version(s) old; "
        f"{rollout.active_groups or (staleness + 1) * per_step} prompt groups in flight for {per_step} a step, "
        f"{plan.chunk_tokens} tokens per engine call; {seen} (docs/async.md)"
    ]


def start_lines(cfg: EasyRLConfig, task: str) -> tuple[list[str], list[str]]:
    """(the plan, the warnings) a run logs before it starts: `task` `rl` (`easyrl train`) or `sft`."""
    if task == "sft":
        return sft_plan_lines(cfg), [w for w in (cpu_noop_warning(cfg),) if w is not None]
    warnings = (cpu_noop_warning(cfg), kl_noop_warning(cfg), family_warning(cfg))
    return plan_lines(cfg), [w for w in warnings if w is not None]


def family_warning(cfg: EasyRLConfig) -> str | None:
    """The warning for a model whose `model_type` has no family profile (`easyrl.models.family`; the config check
    found its config.json); none for a diffusers pipeline folder (no LLM family, no root config.json)."""
    config_json = Path(cfg.worker.actor.model.model_path or "") / "config.json"
    if not config_json.is_file() and (config_json.parent / "model_index.json").is_file():
        return None
    return unlisted_family_warning(str(json.loads(config_json.read_text()).get("model_type")))


def rerun_line(cfg: EasyRLConfig) -> str:
    """What running the same command again does after a stop (Ctrl-C, SIGTERM): resume, or start over and why."""
    from easyrl.checkpoint.manager import newest_resumable

    t = cfg.trainer
    if t.load_checkpoint_path:
        return f"the same command resumes from {t.load_checkpoint_path} (trainer.load_checkpoint_path)"
    assert t.save_checkpoint_path is not None  # the loader sets it
    newest = newest_resumable(t.save_checkpoint_path) if t.find_last_checkpoint else None
    if newest is not None:
        return f"the same command resumes from {newest}"
    if not t.find_last_checkpoint:
        return "the same command starts again from step 1 (trainer.find_last_checkpoint=false)"
    return (
        "no checkpoint to resume from, so the same command starts again from step 1 "
        "(trainer.save_on_interrupt=true saves one when stopped; trainer.save_freq=N every N steps)"
    )


def old_log_probs_line(cfg: EasyRLConfig, plan: RunPlan) -> str:
    """Where the update's old log-probs come from, and the rollout correction applied to them."""
    corr = cfg.algorithm.correction
    if corr.bypass_mode:
        return "the rollout engine's (rollout_correction.bypass_mode: no forward pass)"
    source = old_pass_source(cfg, plan)
    parts = [f"rollout_is: {corr.rollout_is}"] if corr.rollout_is is not None else []
    parts += [f"rollout_rs: {corr.rollout_rs}"] if corr.rollout_rs is not None else []
    parts += ["token veto"] if corr.rollout_token_veto_threshold is not None else []
    return source + (f"; rollout correction: {', '.join(parts)}" if parts else "")


def old_pass_source(cfg: EasyRLConfig, plan: RunPlan) -> str:
    """Where each mini-batch's old log-probs come from (`RunPlan.old_log_prob_pass`), and why mini-batch 1's do."""
    rows = plan.old_log_prob_pass
    if rows is OldPass.NONE:
        return "the update's own, detached (1 pass)"
    reuse, why = effective_reuse_first_forward(cfg, plan.use_gpu)
    if rows is OldPass.AFTER_FIRST_MINI_BATCH:
        return (
            "mini-batch 1: the update's own first forward, detached; the others: a forward pass inside the update, "
            f"before its first optimizer step (worker.actor.reuse_first_forward: {why})"
        )
    if reuse:  # on, yet every row: a reader before the update needs them all
        return "a forward pass before the update, every mini-batch (read before the update, so none reused)"
    return f"a forward pass before the update, every mini-batch (worker.actor.reuse_first_forward off: {why})"


def validation_line(cfg: EasyRLConfig) -> str:
    """What validation measures: greedy decoding shows little of what training changed in a model that is already
    good at it; samples do (the demo: greedy 0.92 before and after, sampled 0.24 -> 0.79)."""
    if not cfg.data.val_files:
        return "validation: none (no data.val_files)"
    sampling = {"temperature": cfg.worker.rollout.temperature, "n": 1, **cfg.worker.rollout.val_override_config}
    n, temperature = int(sampling["n"]), float(sampling["temperature"])
    if temperature == 0:
        return f"validation: greedy, {n} response(s) per prompt (val/reward/overall)"
    return (
        f"validation: {n} sample(s) per prompt at temperature {temperature} (val/reward/mean@{n}, "
        f"val/reward/best@{n}, val/pass@{n}: a prompt passes when one of its samples has accuracy 1, or overall 1 "
        "for a reward function without an accuracy score)"
    )


def memory_plan_lines(cfg: EasyRLConfig, gpu_memory_gib: float | None = None) -> tuple[list[str], list[str]]:
    """(the memory plan of one GPU, why it cannot fit and what fixes it); the arithmetic is `easyrl.memory_plan`'s.
    The GPU is this machine's for a run that trains on GPUs here, or one of `gpu_memory_gib` GiB (`easyrl check
    --gpu-memory`: a login node planning the run it sends to the GPUs). Nothing without either."""
    import torch

    on_gpu = plan_of(cfg).use_gpu and torch.cuda.is_available()
    if gpu_memory_gib is None and not on_gpu:
        return [], []
    from transformers import AutoConfig

    from easyrl.memory_plan import GiB, ModelShape

    mcfg = cfg.worker.actor.model
    assert mcfg.model_path is not None
    hf_config = AutoConfig.from_pretrained(mcfg.model_path, trust_remote_code=mcfg.trust_remote_code)
    shape = ModelShape.from_hf_config(hf_config)
    if gpu_memory_gib is not None:
        total = int(gpu_memory_gib * GiB)
        device = f"GPU: {gpu_memory_gib:g} GiB, as --gpu-memory says (this machine's GPUs are not read)"
    else:
        free, total = torch.cuda.mem_get_info()
        device = f"GPU: {torch.cuda.get_device_name()}, {total / GiB:.1f} GiB, {free / GiB:.1f} GiB free now"
    lines, problems = memory_report(shape, cfg, total)
    long_lines, long_problem = long_sample_report(hf_config, shape, cfg, total)
    return [device, *lines, *long_lines], problems + ([long_problem] if long_problem else [])


def memory_report(shape: Any, cfg: EasyRLConfig, device_total: int) -> tuple[list[str], list[str]]:
    """The update levers the plan chose (`easyrl.update_levers`, with the figures they compared), the plan's lines
    with those levers and, when it does not fit, its problems followed by the settings that make it fit."""
    from easyrl.memory_plan import plan_fixes, plan_lines, plan_memory, plan_problems
    from easyrl.update_levers import choose_levers, resolved_config

    levers = choose_levers(cfg, True, plan_of(cfg).world_size, shape, device_total)
    cfg = resolved_config(cfg, levers)
    plan = plan_memory(shape, cfg, device_total)
    problems = plan_problems(plan)
    if problems:
        problems += [f"fits with {fix}" for fix in plan_fixes(shape, cfg, device_total)]
    return [f"update lever: {line}" for line in levers.lines()] + plan_lines(plan), problems


def lever_lines(cfg: EasyRLConfig, gpu_memory_gib: float | None = None) -> list[str]:
    """The update levers as this machine decides them without a memory plan (the plan's section prints its own)."""
    import torch

    plan = plan_of(cfg)
    if gpu_memory_gib is not None or (plan.use_gpu and torch.cuda.is_available()):
        return []
    from easyrl.update_levers import choose_levers

    return [f"update lever: {line}" for line in choose_levers(cfg, plan.use_gpu, plan.world_size, None, None).lines()]


def cpu_noop_settings(cfg: EasyRLConfig) -> list[str]:
    """GPU-only settings this config turns on, as `key=value`; a CPU run accepts them and they do nothing there."""
    from easyrl.config import RolloutConfig

    found = []
    for role in ("actor", "ref", "critic"):
        wcfg = getattr(cfg.worker, role)
        if wcfg.fsdp.enable_cpu_offload:
            found.append(f"worker.{role}.fsdp.enable_cpu_offload=true")
        for key in ("offload_params", "offload_optimizer"):
            if getattr(wcfg.offload, key):
                found.append(f"worker.{role}.offload.{key}=true")
    if cfg.worker.rollout.enforce_eager:
        found.append("worker.rollout.enforce_eager=true")
    if cfg.worker.rollout.gpu_memory_utilization != RolloutConfig.gpu_memory_utilization:
        found.append(f"worker.rollout.gpu_memory_utilization={cfg.worker.rollout.gpu_memory_utilization}")
    return found


def cpu_noop_warning(cfg: EasyRLConfig) -> str | None:
    """The one warning a CPU run gives for its GPU-only settings (None on GPU runs or when there are none)."""

    found = cpu_noop_settings(cfg)
    if not found or plan_of(cfg).use_gpu:
        return None
    return f"running on CPU: GPU-only settings have no effect here (see docs/faq.md): {', '.join(found)}"


def kl_noop_warning(cfg: EasyRLConfig) -> str | None:
    """`algorithm.use_kl_loss: true` under `disable_kl: true` (as in configs/demo.yaml) trains without a KL, as in
    EasyR1: said once, since the key was set to get one."""
    if not (cfg.algorithm.disable_kl and cfg.algorithm.use_kl_loss):
        return None
    return (
        "algorithm.use_kl_loss=true has no effect: algorithm.disable_kl=true turns the KL (and the reference model) "
        "off; set algorithm.disable_kl=false to train with the KL loss"
    )


def _engine_check(cfg: EasyRLConfig) -> EngineCheck:
    from easyrl.rollout.registry import engine_check

    return engine_check(cfg.worker.rollout.name)


def rollout_problem(cfg: EasyRLConfig) -> str | None:
    """What would stop the rollout engine from starting on this machine, found without starting it (the engine's
    `EngineCheck`: for vLLM, `easyrl.rollout.vllm_check`)."""
    return _engine_check(cfg).problem(cfg, plan_of(cfg).use_gpu)


def engine_lines(cfg: EasyRLConfig) -> list[str]:
    """The plan's lines of the rollout engine (for vLLM: the names of its engine arguments, its GDN kernel)."""
    return _engine_check(cfg).plan_lines(cfg)


def engine_version_line(cfg: EasyRLConfig) -> str | None:
    """Why the installed engine is not a version easyrl has run on this kind of machine, if so."""
    return _engine_check(cfg).version_warning(plan_of(cfg).use_gpu)


def print_memory_plan(cfg: EasyRLConfig, gpu_memory_gib: float | None = None) -> int:
    """Print the memory plan of one GPU (on a GPU machine, or of `gpu_memory_gib` GiB); 2 when its arithmetic says
    the run cannot fit, refused before a GPU hour is spent finding out, with the settings that make it fit."""
    memory, problems = memory_plan_lines(cfg, gpu_memory_gib)
    if memory:
        print("== memory plan (one GPU, estimates: easyrl/memory_plan.py)", file=sys.stdout)
        for line in memory:
            print(line, file=sys.stdout)
    for problem in problems:
        print(f"easyrl: memory error: {problem}", file=sys.stderr)
    return 2 if problems else 0


def placement_problem(cfg: EasyRLConfig, gpus: int | None = None) -> str | None:
    """What this machine lacks for the run's workers, found now rather than when a placement group has waited out
    its minute: `train`'s Ray instance gives each worker of the actor's pool and of a separate rollout pool one CPU
    slot (`trainer.ray_num_cpus` of them, when set) and, on a GPU run, one GPU. None where `check` cannot tell (a
    cluster behind RAY_ADDRESS, several nodes, a machine without GPUs). `gpus`: the machine's GPU count (default:
    torch's)."""
    if cfg.trainer.nnodes != 1 or os.environ.get("RAY_ADDRESS"):
        return None
    plan = plan_of(cfg)
    trainers, rollout = cfg.trainer.n_gpus_per_node, plan.own_rollout_workers
    need = trainers + rollout
    who = f"trainer.n_gpus_per_node={trainers}" + (
        f" trainer workers + worker.rollout.n_gpus={rollout} rollout workers of placement: separate" if rollout else ""
    )
    cpus = cfg.trainer.ray_num_cpus
    if cpus and cpus < need:
        return (
            f"trainer.ray_num_cpus={cpus} gives Ray fewer CPU slots than the {need} its workers take, one each "
            f"({who}): raise it to {need} or leave it unset"
        )
    if plan.use_gpu:
        import torch

        judge = cfg.worker.reward.judge
        need += judge.server.num_gpus if judge.model.local else 0
        have = torch.cuda.device_count() if gpus is None else gpus
        if 0 < have < need:  # none at all: a login node checking a config for a GPU node, which it cannot judge
            served = f" + worker.reward.judge.server.num_gpus={judge.server.num_gpus}" if judge.model.local else ""
            return f"this machine has {have} GPU(s); the run takes {need}, one per worker ({who}{served})"
    return None


def _load_data(build: Any, cfg: EasyRLConfig) -> tuple[Any, Any] | None:
    """(train, val) as `build` (the trainer's loader) makes them; None, after one line naming the problem, when the
    data or the config cannot be used."""
    from easyrl.config import ConfigError
    from easyrl.data.loading import DataError

    try:
        _, train, val, _ = build(cfg)
    except DataError as exc:
        print(f"easyrl: data error: {exc}", file=sys.stderr)
        return None
    except ConfigError as exc:
        print(f"easyrl: config error: {exc}", file=sys.stderr)
        return None
    return train, val


def run_check(cfg: EasyRLConfig, gpu_memory_gib: float | None = None) -> int:
    """Load tokenizer and data, render and tokenize prompts, call the reward function once; print a report (with
    the memory plan of one GPU of `gpu_memory_gib` GiB when given, else of this machine's GPU if it has one)."""
    from easyrl.trainer.worker_groups import build_data

    if is_diffusion_run(cfg):  # a pipeline: its own prompt, sample, reward call and plans
        from easyrl.diffusion_check import run_diffusion_check

        return run_diffusion_check(cfg, gpu_memory_gib)
    out = sys.stdout
    problem = rollout_problem(cfg)
    if problem is not None:
        if cfg.trainer.device == "auto" and not plan_of(cfg).use_gpu:  # a login node, maybe: only a warning
            print(f"easyrl: warning: {problem} (no GPU on this machine: ignore this if the run goes to one)", file=out)
        else:
            print(f"easyrl: rollout error: {problem}", file=sys.stderr)
            return 2
    placement = placement_problem(cfg)
    if placement is not None:
        print(f"easyrl: placement error: {placement}", file=sys.stderr)
        return 2
    version = engine_version_line(cfg)
    if version is not None:
        print(f"easyrl: warning: {version}", file=out)
    for warning in (cpu_noop_warning(cfg), kl_noop_warning(cfg)):
        if warning is not None:
            print(f"easyrl: warning: {warning}", file=out)
    loaded = _load_data(build_data, cfg)  # the trainer's own loading: the prompts checked are the ones trained on
    if loaded is None:
        return 2
    train, val = loaded
    _print_data(cfg, train, val)
    print("== first prompt, rendered", file=out)
    first = train[0]
    print(first["raw_prompt"], file=out)
    if cfg.worker.rollout.multi_turn.enabled and _check_multi_turn(cfg, first) != 0:
        return 2
    if _check_reward(cfg, first) != 0:
        return 2
    print("== plan", file=out)
    for line in plan_lines(cfg) + engine_lines(cfg) + multi_turn_lines(cfg) + lever_lines(cfg, gpu_memory_gib):
        print(line, file=out)
    return print_memory_plan(cfg, gpu_memory_gib)


def _print_data(cfg: EasyRLConfig, train: Any, val: Any) -> None:
    """What was kept of the data, what was dropped and why, and the prompt lengths against the limit."""
    out = sys.stdout
    print("== data", file=out)
    print(f"train: {len(train)} usable rows from {cfg.data.train_files}", file=out)
    dropped = {k: v for k, v in train.drop_counts.items() if v}
    print(f"dropped: {dropped or 'none'}", file=out)
    if val is not None:
        val_dropped = {k: v for k, v in val.drop_counts.items() if v}
        print(f"val: {len(val)} usable rows from {cfg.data.val_files}; dropped: {val_dropped or 'none'}", file=out)
    stats = train.prompt_length_stats()
    print(
        "prompt tokens: "
        + ", ".join(f"{k}={v:.1f}" for k, v in stats.items())
        + f" (max_prompt_length={cfg.data.max_prompt_length}, over it: {dropped.get('overlong_prompt', 0)})",
        file=out,
    )
    media = train.media_token_stats()
    if media:
        print(
            "media: "
            + ", ".join(f"{k}={v:g}" for k, v in media.items())
            + " (prompt lengths above include them; rows whose media push the prompt past max_prompt_length are"
            " counted under overlong_prompt, the 'image features and image tokens do not match' failure)",
            file=out,
        )


def _check_reward(cfg: EasyRLConfig, first: dict[str, Any]) -> int:
    """Score the first row's ground truth as its response; 2, with one line, when the function cannot be loaded or
    fails on it (a reward that cannot score the right answer would train on fallback scores)."""
    from easyrl.rewards import RewardError, RewardLoadError, RewardManager

    print("== reward function", file=sys.stdout)
    if cfg.worker.reward.judge.model.local:  # loading a model into a server for one sample is a run's job
        print(
            f"not called: its judge ({cfg.worker.reward.judge.model.model_path}) is served by `easyrl train` when the "
            "run starts",
            file=sys.stdout,
        )
        return 0
    sample = {
        **first["row"],
        "prompt": first["raw_prompt"],
        "response": str(first["ground_truth"]),
        "response_length": 1,
        "ground_truth": first["ground_truth"],
    }
    try:
        with RewardManager(cfg.worker.reward) as manager:
            scores, _ = manager.score([sample])
    except (RewardLoadError, RewardError) as exc:
        print(f"easyrl: reward error: {exc}", file=sys.stderr)
        return 2
    print(f"{cfg.worker.reward.reward_function} on the ground truth as response: {scores[0]}", file=sys.stdout)
    return 0


def multi_turn_lines(cfg: EasyRLConfig) -> list[str]:
    """The plan's multi-turn line (none for a single-turn run)."""
    mt = cfg.worker.rollout.multi_turn
    if not mt.enabled:
        return []
    envs = ", ".join(f"{name}={spec}" for name, spec in mt.env_specs().items()) or "none (the dataset's prompts)"
    budget = mt.max_total_tokens or cfg.data.max_response_length
    tools = mt.tools or "the environment's methods"
    return [
        f"multi-turn: environment {envs}; tools {tools}; up to {mt.max_turns} turns, "
        f"{budget} tokens per trajectory after the prompt, {mt.tool_timeout_s:g} s per tool call"
    ]


def _check_multi_turn(cfg: EasyRLConfig, first: dict[str, Any]) -> int:
    """Import the environments and tools (every schema made), open the first row's episode and print its prompt as
    the loop renders it, tools included; 2, with one line, when any of it fails."""
    from easyrl.agent import AgentLoadError
    from easyrl.trainer.resolve import multi_turn_loop

    print("== first multi-turn prompt, rendered with the tools", file=sys.stdout)
    try:
        loop: Any = multi_turn_loop(cfg, plan_of(cfg))
    except (AgentLoadError, ValueError) as exc:
        print(f"easyrl: multi-turn error: {exc}", file=sys.stderr)
        return 2
    problem = constructor_problem(loop.environments.types)
    if problem is not None:
        print(f"easyrl: multi-turn error: {problem}", file=sys.stderr)
        return 2
    try:
        episode = loop.environments.start(first["row"])
        if episode.error is not None:  # in training only this row's trajectories would be dropped; here: say it
            raise AgentLoadError(f"the first row's episode did not open: {episode.error}")
        text = loop.chat.render(episode.messages, episode.schemas)
    except (AgentLoadError, ValueError) as exc:
        print(f"easyrl: multi-turn error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the user's environment code, on the first row: one line naming it, not a traceback
        print(
            f"easyrl: multi-turn error: the first row's episode failed: {type(exc).__name__}: {exc}", file=sys.stderr
        )
        return 2
    tokens = len(loop.chat.encode(text))
    print(text, file=sys.stdout)
    names = [s["function"]["name"] for s in episode.schemas]
    print(f"({tokens} tokens of data.max_prompt_length={cfg.data.max_prompt_length}; tools: {names})", file=sys.stdout)
    if tokens > cfg.data.max_prompt_length:
        print(
            f"easyrl: multi-turn error: the prompt with its tools has {tokens} tokens > data.max_prompt_length",
            file=sys.stderr,
        )
        return 2
    return 0


def constructor_problem(env_types: dict[str, Any]) -> str | None:
    """The first environment class that cannot be built without arguments, as every episode builds one."""
    for name, env_type in env_types.items():
        cls = env_type.cls
        if cls is None:
            continue
        try:
            signature = inspect.signature(cls)
        except (TypeError, ValueError):  # a class without a readable signature (a C type): left to the first episode
            continue
        try:
            signature.bind()
        except TypeError:
            needed = [
                p.name
                for p in signature.parameters.values()
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            ]
            return (
                f"environment {name} ({cls.__module__}.{cls.__qualname__}) takes constructor arguments "
                f"({', '.join(needed)}); each episode builds one with none: give them defaults, or read them from "
                "the row in reset(**row)"
            )
    return None


# ---------------------------------------------------------------------------------------------- supervised fine-tuning
def _sp_layout(actor: ActorConfig) -> str:
    """The sequence-parallel group as `easyrl check` prints it: ``4`` (Ulysses), ``2 x ring 2`` (with a ring)."""
    return str(actor.ulysses_size) if actor.ring_size == 1 else f"{actor.ulysses_size} x ring {actor.ring_size}"


def _adapters(lora: LoraConfig) -> str:
    """` (LoRA rank r, alpha a)` after a role trained with adapters; empty without."""
    return f" (LoRA rank {lora.rank}, alpha {lora.alpha})" if lora.rank else ""


def sft_plan_lines(cfg: EasyRLConfig) -> list[str]:
    """What `easyrl sft` will run: objective, model, workers and the batch arithmetic."""
    a, d, t = cfg.worker.actor, cfg.data, cfg.trainer
    plan = plan_of(cfg, "sft")
    workers, dp = plan.world_size, plan.data_parallel_size
    sp = f"; sequence parallel {_sp_layout(a)} ({dp} data-parallel groups)" if a.sp_size > 1 else ""
    adapters = _adapters(a.model.lora)
    micro = (
        f"micro-batches of up to {a.max_token_len_per_gpu} tokens per worker"
        if a.dynamic_batching
        else f"micro-batches of {a.micro_batch_size_per_device_for_update}"
    )
    every = f"every {t.val_freq} steps and at the end" if t.val_freq > 0 else "never during training"
    validation = (
        f"validation: val/loss, val/token_accuracy, val/perplexity on {d.val_files} ({every}"
        + (", and before training)" if t.val_before_train else ")")
        if d.val_files
        else "validation: none (no data.val_files)"
    )
    return [
        f"supervised fine-tuning: next-token loss on the assistant's tokens ({a.loss_avg_mode}), conversations of up "
        f"to {cfg.sft.max_length} tokens",
        f"model: {a.model.model_path}{adapters}",
        f"attention (training, on this machine): {attention_kernel(plan.padding_free)}",
        f"workers: {t.nnodes} node(s) x {t.n_gpus_per_node} = {workers}{sp}",
        backend_line(plan),
        f"batch: {a.global_batch_size} rows per step (one optimizer step, lr {a.optim.lr:g}, "
        f"{a.optim.lr_scheduler_type}); {a.global_batch_size // dp} rows per worker in {micro}",
        validation,
        f"output: {t.save_checkpoint_path} (`easyrl merge` makes a Hugging Face folder of a global_step_<N>)",
    ]


def run_sft_check(cfg: EasyRLConfig) -> int:
    """Load the tokenizer and the conversations as `easyrl sft` does, mark their assistant tokens with the chat
    template, and print what was kept, the first conversation with its trained tokens between [[ and ]], and the
    plan. 2, with one line, when the data or the template cannot be used."""
    from easyrl.trainer.sft_trainer import build_sft_data

    out = sys.stdout
    warning = cpu_noop_warning(cfg)
    if warning is not None:
        print(f"easyrl: warning: {warning}", file=out)
    loaded = _load_data(build_sft_data, cfg)  # the trainer's own loading: the conversations checked are trained on
    if loaded is None:
        return 2
    train, val = loaded
    _print_sft_data(cfg, train, val)
    print("== first conversation, trained tokens between [[ and ]]", file=out)
    print(train.marked_text(0), file=out)
    print("== plan", file=out)
    for line in sft_plan_lines(cfg):
        print(line, file=out)
    return 0


def _print_sft_data(cfg: EasyRLConfig, train: Any, val: Any) -> None:
    """What was kept of the conversations and why the rest was not, their lengths, and how the tokens are marked."""
    lines = ["== data"]
    for name, data, files in (("train", train, cfg.data.train_files), ("val", val, cfg.data.val_files)):
        if data is not None:
            dropped = {k: v for k, v in data.drop_counts.items() if v}
            lines.append(f"{name}: {len(data)} usable conversations from {files}; dropped: {dropped or 'none'}")
    stats = train.length_stats()
    for prefix, what in (("tokens_", "tokens"), ("trained_", "trained tokens")):
        values = ", ".join(f"{k[len(prefix) :]}={v:.1f}" for k, v in stats.items() if k.startswith(prefix))
        lines.append(f"{what} per conversation: {values}")
    how = (
        "its {% generation %} marks" if train.chat.generation_marks else "rendering each conversation prefix by prefix"
    )
    lines.append(f"assistant tokens: marked by the chat template, {how}")
    print("\n".join(lines), file=sys.stdout)


def long_sample_report(
    hf_config: Any, shape: Any, cfg: EasyRLConfig, device_total: int
) -> tuple[list[str], str | None]:
    """(the per-rank plan of the config's longest sample, why it cannot fit) when samples are long (at least
    `LONG_SAMPLE_TOKENS`); the arithmetic is `easyrl.long_sample_plan`'s."""
    from easyrl.long_sample_plan import (
        LONG_SAMPLE_TOKENS,
        VisionShape,
        long_sample_lines,
        long_sample_problem,
        plan_long_sample,
    )

    if cfg.data.max_prompt_length + cfg.data.max_response_length < LONG_SAMPLE_TOKENS:
        return [], None
    plan = plan_long_sample(shape, VisionShape.from_hf_config(hf_config), cfg, device_total)
    return long_sample_lines(plan), long_sample_problem(plan)


def long_sample_refusal(cfg: EasyRLConfig) -> str | None:
    """Why the config's longest sample cannot fit this machine's GPU (None when it fits, when samples are short, or
    when the run does not train on a GPU here): `easyrl train` says it before any worker starts."""
    import torch

    from easyrl.long_sample_plan import LONG_SAMPLE_TOKENS

    if cfg.data.max_prompt_length + cfg.data.max_response_length < LONG_SAMPLE_TOKENS:
        return None
    if not (plan_of(cfg).use_gpu and torch.cuda.is_available()):
        return None
    from transformers import AutoConfig

    from easyrl.memory_plan import ModelShape

    mcfg = cfg.worker.actor.model
    assert mcfg.model_path is not None
    hf_config = AutoConfig.from_pretrained(mcfg.model_path, trust_remote_code=mcfg.trust_remote_code)
    _, total = torch.cuda.mem_get_info()
    return long_sample_report(hf_config, ModelShape.from_hf_config(hf_config), cfg, total)[1]
