"""What logging `actor/entropy` costs the actor update: one update step (forward, backward, optimizer step) without
the entropy and with it as a detached metric, side by side, on the head paths the actor runs; the median wall and
CPU seconds per step of each, over `--steps` measured steps after one warm-up.

    python scripts/bench_entropy.py                      # CPU, fp32, a small Qwen2 with a 32k vocabulary
    python scripts/bench_entropy.py --device cuda --dtype bf16 --hidden 1536 --layers 4 --vocab 151936 --seqs 32

* off: what the update ran before `actor/entropy` was always logged (no bonus: log-probs only);
* on: what it runs now (`entropy_grad=False`: the entropy of the same forward, no graph).

The two variants train two copies of one model on the same batch, alternating step by step so that a busy machine
slows both alike, and the script checks that their parameters stay bit-identical: the metric must not change the
update. The loss is the actor's (`easyrl.workers.actor.policy_objective`: PPO clip, no bonus) over one mini-batch
of `--micro` micro-batches, as `ActorWorker._loss_fn` calls it. On CUDA it also prints each variant's peak memory.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from easyrl.algorithms import entropy_from_logits  # after the path line: the checkout's easyrl
from easyrl.batch import Batch
from easyrl.workers.forward_backward import LossFn, MicroBatchLoss
from easyrl.workers.specs import ForwardOptions, PolicyLossSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seqs", type=int, default=8, help="rows in the mini-batch")
    ap.add_argument("--len", type=int, default=512, help="longest row (prompt + response)")
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per mini-batch")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per variant (after one warm-up)")
    args = ap.parse_args()
    if args.steps < 1 or args.seqs % args.micro:
        ap.error(f"--steps must be >= 1 and --seqs ({args.seqs}) a multiple of --micro ({args.micro})")

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from easyrl.workers.varlen import register_varlen_attention

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=4 * args.hidden,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(cfg).to(device, dtype).train()
    batch = _batch(args.seqs, args.len, args.vocab)
    tokens = int(batch["loss_mask"].sum())
    print(f"{args.seqs} rows, {tokens} response tokens, vocab {args.vocab}; {args.device} {args.dtype}")
    print(f"{'head path (seconds)':30s} {'off (s/step)':>10s} {'on (s/step)':>14s} {'cost':>8s}  actor/entropy")

    paths = {
        "padded, full logits": ("sdpa", ForwardOptions(fused=False)),
        "packed, fused head": (register_varlen_attention(), ForwardOptions(padding_free=True, fused=True)),
    }
    for name, (attn, opts) in paths.items():
        models = {variant: copy.deepcopy(base) for variant in ("off", "on")}
        optims = {v: torch.optim.AdamW(m.parameters(), lr=1e-4) for v, m in models.items()}
        times: dict[str, list[float]] = {"off": [], "on": []}
        cpus: dict[str, list[float]] = {"off": [], "on": []}
        peaks: dict[str, float] = {}
        entropy = float("nan")
        for step in range(1 + args.steps):  # step 0 warms up
            for variant, model in models.items():
                model.set_attn_implementation(attn)
                metric = variant == "on"

                loss_fn = _loss_fn(model, device, opts, metric)
                elapsed, cpu, metrics = _timed_step(model, optims[variant], batch, loss_fn, args.micro, device)
                if step:
                    times[variant].append(elapsed)
                    cpus[variant].append(cpu)
                if metric:
                    entropy = metrics["actor/entropy"]
                if device.type == "cuda":
                    peaks[variant] = torch.cuda.max_memory_allocated(device) / 2**30
        same = all(torch.equal(a, b) for a, b in zip(models["off"].parameters(), models["on"].parameters()))
        if not same:
            raise SystemExit(f"{name}: the entropy metric changed the update (parameters differ): a bug")
        for label, values in (("wall", times), ("cpu", cpus)):
            off, on = statistics.median(values["off"]), statistics.median(values["on"])
            cost = f"{100 * (on / off - 1):+7.1f}%"
            print(f"{name + ' (' + label + ')':30s} {off:10.3f} {on:14.3f} {cost:>8s}  {entropy:.4f}")
            print(f"{'':30s} off steps {_fmt(values['off'])}; on steps {_fmt(values['on'])}")
        if peaks:
            print(f"{'':30s} peak memory off {peaks['off']:.3f} GiB, on {peaks['on']:.3f} GiB")
    print("parameters bit-identical with and without the metric on every path")
    # The work the full-logits head adds, alone (less swayed by a busy machine than a whole step): the entropy of
    # every response token's logits, chunked, under no_grad. The fused head adds none: it computes it anyway.
    logits = torch.randn(tokens, args.vocab, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    added = _median_seconds(lambda: entropy_from_logits(logits), args.steps, device)
    print(f"the added work alone (entropy_from_logits on ({tokens}, {args.vocab}) logits, no_grad): {added:.3f} s")


def _loss_fn(model: torch.nn.Module, device: torch.device, opts: ForwardOptions, metric: bool) -> LossFn:
    """The actor's micro-batch loss without a bonus (`ActorWorker._loss_fn`'s calls), with or without the entropy
    metric."""
    from easyrl.workers.actor import policy_objective
    from easyrl.workers.forward_backward import token_log_probs

    params = (("clip_ratio_low", 0.2), ("clip_ratio_high", 0.3), ("clip_ratio_dual", 3.0))  # the config defaults
    spec = PolicyLossSpec("ppo", params, kl_in_loss=False, kl_penalty="low_var_kl", kl_coef=0.0)

    def loss_fn(mb: Batch, on_device: Batch) -> MicroBatchLoss:
        lp, ent = token_log_probs(model, mb, device, 1.0, metric, opts=opts, entropy_grad=False)
        return policy_objective(on_device, lp, ent, spec, "token-mean", 0.0)

    return loss_fn


@torch.no_grad()
def _median_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall seconds of `repeats` calls of `fn` after one warm-up."""
    times = []
    for i in range(1 + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def _batch(rows: int, length: int, vocab: int) -> Batch:
    """Left-padded prompts and right-padded responses, lengths uniform in [length/4, length], random advantages."""
    g = torch.Generator().manual_seed(0)
    prompt_w, resp_w = length // 2, length // 2
    mask = torch.zeros(rows, prompt_w + resp_w, dtype=torch.long)
    for i in range(rows):
        total = int(torch.randint(length // 4, length + 1, (), generator=g))
        p = max(1, total // 2)
        mask[i, prompt_w - p : prompt_w] = 1
        mask[i, prompt_w : prompt_w + total - p] = 1
    ids = torch.randint(3, vocab, mask.shape, generator=g) * mask
    response_mask = mask[:, prompt_w:].clone()
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "prompts": ids[:, :prompt_w],
            "responses": ids[:, prompt_w:],
            "response_mask": response_mask,
            "loss_mask": response_mask.clone(),
            "advantages": torch.randn(rows, resp_w, generator=g),
        }
    )


def _timed_step(
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    batch: Batch,
    loss_fn: LossFn,
    micro: int,
    device: torch.device,
) -> tuple[float, float, dict[str, float]]:
    """One update step (one mini-batch of `micro` micro-batches): its wall seconds, this process's CPU seconds (all
    threads: less swayed by other jobs on a shared machine than the wall time) and its metrics."""
    from easyrl.config import OptimConfig
    from easyrl.workers.forward_backward import optimize
    from easyrl.workers.model_setup import build_scheduler

    sched = build_scheduler(optim, OptimConfig(lr=1e-4), 10)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    start, cpu = time.perf_counter(), time.process_time()
    metrics = optimize(
        model, optim, sched, batch, device=device, mini_batch_size=len(batch),
        micro_batch_size=len(batch) // micro, epochs=1, max_grad_norm=1.0, loss_fn=loss_fn, prefix="actor",
    )  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - cpu, metrics


if __name__ == "__main__":
    main()
