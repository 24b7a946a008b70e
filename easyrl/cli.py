"""`easyrl train|sft|check|cache-embeds CONFIG [key=value ...]`: parse, build, run, close."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from typing import TYPE_CHECKING

from easyrl import __version__
from easyrl.signals import (
    StartupInterrupted,
    exit_code,
    exit_promptly,
    install_early_handlers,
    install_stop_handlers,
    startup_interruption,
)


if TYPE_CHECKING:
    from easyrl.config import EasyRLConfig, Secrets
    from easyrl.trainer.run import RunFolder


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="easyrl", description="RL post-training for LLMs and VLMs.")
    parser.add_argument("--version", action="version", version=f"easyrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("train", "train with a YAML config; `key=value` arguments override it"),
        ("sft", "supervised fine-tuning with a YAML config (its `sft` section); `key=value` arguments override it"),
        ("check", "validate a config, its data, templates and reward function (SFT configs too); no training, no GPU"),
        ("cache-embeds", "fill data.cache_dir with the vision tower's outputs of the config's images and videos"),
    ):
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("config", help="path to the YAML config")
        cmd.add_argument("overrides", nargs="*", help="overrides such as worker.rollout.n=8")
        if name == "check":
            cmd.add_argument(
                "--gpu-memory",
                type=float,
                default=None,
                metavar="GIB",
                help="print the memory plan of an RL run on GPUs of GIB GiB each (80 for an H100), with or without a GPU here",
            )
    sub.add_parser("merge", add_help=False, help="merge a sharded checkpoint into a Hugging Face folder")
    text = "write an HTML report (curves and validation generations) of a run folder's file-logger output"
    report = sub.add_parser("report", help=text, description=text)
    report.add_argument("run_dir", help="the run folder holding experiment_log.jsonl and generations.jsonl")
    report.add_argument("--output", default=None, help="HTML file to write (default RUN_DIR/report.html)")
    return parser


def main(argv: list[str] | None = None) -> int:
    install_early_handlers()  # SIGTERM/SIGINT/SIGHUP give 143/130/129 from here on, as they do during training
    try:
        code = _main(argv)
    except StartupInterrupted as exc:
        _say(f"easyrl: {exc}")
        code = exit_code(exc.signum)
    if argv is None:  # the process is ours (the `easyrl` command): exit hooks run, the slow module teardown does not
        exit_promptly(code)
    return code


def _say(line: str) -> None:
    """One line on stderr; after a hang-up the terminal may be gone, and a failed write must not replace the exit."""
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr)


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["merge"]:  # `easyrl merge` has its own parser
        from easyrl.merge import main as merge_main

        return merge_main(argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    if args.command == "report":
        from easyrl.report import build_report

        try:
            print(build_report(args.run_dir, args.output))
        except (FileNotFoundError, FileExistsError, ImportError) as exc:
            print(f"easyrl: {exc}", file=sys.stderr)
            return 2
        return 0
    from easyrl.config import ConfigError, load_config_and_secrets
    from easyrl.config.loader import config_task
    from easyrl.config.secrets import guard_console

    notes: list[str] = []
    try:
        # `check` checks a config as what it is: an SFT config has an `sft` section
        task = {"train": "rl", "sft": "sft"}.get(args.command) or config_task(args.config, args.overrides)
        cfg, secrets = load_config_and_secrets(args.config, args.overrides, notes, task)
    except ConfigError as exc:
        print(f"easyrl: config error: {exc}", file=sys.stderr)
        return 2
    guard_console(secrets)
    for note in notes:
        logging.getLogger("easyrl").info(note)
    if args.command == "check":
        from easyrl.check import run_check, run_sft_check

        if args.gpu_memory is not None and args.gpu_memory <= 0:
            print(
                f"easyrl: --gpu-memory must be a positive GiB count (80 for an H100), got {args.gpu_memory:g}",
                file=sys.stderr,
            )
            return 2
        if task == "sft" and args.gpu_memory is not None:
            print("easyrl: --gpu-memory plans RL runs; this is an SFT config (drop --gpu-memory)", file=sys.stderr)
            return 2
        return run_sft_check(cfg) if task == "sft" else run_check(cfg, args.gpu_memory)
    if args.command == "cache-embeds":
        from easyrl.cache_embeds import warm_cache

        try:
            print(warm_cache(cfg))
        except ConfigError as exc:
            print(f"easyrl: config error: {exc}", file=sys.stderr)
            return 2
        return 0
    return _train(cfg, secrets, task)


def _train(cfg: EasyRLConfig, secrets: Secrets, task: str) -> int:
    from easyrl.check import rerun_line, start_lines
    from easyrl.config import ConfigError
    from easyrl.distributed.errors import WorkerCallInterrupted
    from easyrl.trainer.run import StopRequested

    log = logging.getLogger("easyrl")
    if task != "sft":  # SFT has no rollout pool: its one pool of trainer workers is what the check counts anyway
        from easyrl.check import placement_problem

        # Ray would only find this when the pool's placement group gives up, a minute in: say it before anything starts
        placement = placement_problem(cfg)
        if placement is not None:
            print(f"easyrl: placement error: {placement}", file=sys.stderr)
            return 2
        from easyrl.check import long_sample_refusal

        refusal = long_sample_refusal(cfg)  # a 256k-token sample that cannot fit: before any worker loads a model
        if refusal is not None:
            print(f"easyrl: memory error: {refusal}", file=sys.stderr)
            return 2
    from easyrl.update_levers import resolve_update_levers

    cfg = resolve_update_levers(cfg, task)  # the levers left on auto, decided once for this machine (logged)
    plan, warnings = start_lines(cfg, task)
    for line in plan:
        log.info(line)
    for line in warnings:
        log.warning(line)
    trainer: RunFolder | None = None
    try:
        if task == "sft":
            from easyrl.trainer.sft_trainer import SFTTrainer

            trainer = SFTTrainer(cfg, secrets)
        else:
            from easyrl.trainer.trainer import Trainer

            trainer = Trainer(cfg, secrets)
        install_stop_handlers(trainer.request_stop, lambda: trainer.stop_signal is not None, cfg.trainer.stop_grace_s)
        trainer.fit()
    except ConfigError as exc:
        print(f"easyrl: config error: {exc}", file=sys.stderr)
        return 2
    except (StopRequested, WorkerCallInterrupted) as exc:  # the latter: a call that outlived the stop's grace
        _say(f"easyrl: {exc}; {rerun_line(cfg)}")
        stopped_by = trainer.stop_signal if trainer is not None else None
        return exit_code(signal.Signals[stopped_by or "SIGTERM"])
    except Exception as exc:
        from easyrl.errors import is_user_facing

        interrupted = startup_interruption(exc)
        if interrupted is not None:  # a signal during start-up that a C extension wrapped: the stop it asked for
            raise interrupted from None
        if not is_user_facing(exc):
            raise
        print(f"easyrl: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if trainer is not None:
            trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
