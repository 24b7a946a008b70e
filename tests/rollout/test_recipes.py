"""The recipes of docs/architecture.md ("Adding a rollout engine", "Adding a rollout loop"), each followed as written
and trained end to end: the new part must train exactly like the part it stands beside.

On CPU: Ray, 2 FSDP2 workers over gloo, the HF engine, the tiny model and the digits task."""

from __future__ import annotations

from pathlib import Path

import pytest

from easyrl.batch import Batch
from easyrl.rollout import EngineSession, SamplingParams
from easyrl.rollout.loop import OneSessionLoop, seeded_request, with_prompts
from tests.conftest import metric_mismatches, train_steps


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]  # Ray: tests/conftest.py
VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/")

# The engine recipe: a file of `algorithm.user_modules` registers a factory under a new name, with what the engine can
# do. This engine is the HF engine with a deep sleep: it drops its weights while the policy trains (as vLLM's sleep
# level 2 does), so it says `discards_weights_on_sleep` and the rollout worker must push the weights again after every
# sleep. It declares tensor parallelism, so `tensor_parallel_size: 2` makes one engine of the two workers: each of
# them is given the whole batch (an HF engine computes it twice, where vLLM's shards would split the work), and it
# writes down what it was given (`{calls}`: the process and the prompts of each call).
USER_ENGINE = """
import os

import torch

from easyrl.rollout import EngineCapabilities, EngineContext, register_engine
from easyrl.rollout.hf import HFRolloutEngine


class DeepSleepHFEngine(HFRolloutEngine):
    discards_weights_on_sleep = True

    def generate(self, prompts, params):
        with open({calls!r}, "a") as calls:
            calls.write(f"{{os.getpid()}} {{len(prompts['input_ids'])}}\\n")
        return super().generate(prompts, params)

    def sleep(self):
        for param in self._params.values():  # tied names share one parameter: dropped once, reloaded once
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def load_weights(self, weights):
        for name, tensor in weights:
            param = self._params[name]
            param.data = tensor.to(param.device, param.dtype).clone()


# override: the test imports this file in several runs
@register_engine("deep_sleep_hf", capabilities=EngineCapabilities(tensor_parallel=True), override=True)
def build(ctx: EngineContext):
    model = ctx.spec.model
    return DeepSleepHFEngine(
        model.model_path, ctx.device, ctx.dtype, ctx.eos_token_ids, ctx.pad_token_id, model.trust_remote_code
    )
"""


def _stable(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in row.items() if not k.startswith(VOLATILE)} for row in rows]


def _assert_same_training(got: list[dict[str, float]], want: list[dict[str, float]]) -> None:
    """Same metrics, step for step, up to float reduction order: the engines see other batch shapes, so the engine vs
    actor log-prob difference (float32 noise, ~1e-7) moves by an ulp or two."""
    bad = metric_mismatches(_stable(got), _stable(want))
    assert not bad, "\n".join(bad)


def test_a_registered_engine_is_built_from_its_name_and_trains_like_the_engine_it_extends(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]
) -> None:
    module, calls = tmp_path / "deep_sleep_engine.py", tmp_path / "calls.txt"
    module.write_text(USER_ENGINE.format(calls=str(calls)))
    edits = {
        "algorithm.user_modules": [str(module)],
        "data.val_files": digits_data["val"],
        "trainer.val_before_train": True,
    }
    hf, _, _ = train_steps(tmp_path / "hf", tiny_model_dir, digits_data, edits, steps=2)
    deep_edits = {**edits, "worker.rollout.name": "deep_sleep_hf", "worker.rollout.tensor_parallel_size": 2}
    deep, _, _ = train_steps(tmp_path / "deep", tiny_model_dir, digits_data, deep_edits, steps=2)
    _assert_same_training(deep, hf)  # the same weights reached the engine after each deep sleep
    # one engine spans both workers (tensor parallel 2, as declared): each was given every prompt of every call
    given: dict[str, list[int]] = {}
    for line in calls.read_text().splitlines():
        pid, prompts = line.split()
        given.setdefault(pid, []).append(int(prompts))
    assert len(given) == 2 and len(set(map(tuple, given.values()))) == 1, given
    # the whole validation set (8 prompts) and a training step's whole data.rollout_batch_size (4), not halves, each
    # prompt's n = 2 samples a request row of their own (the one schedule asks each sample apart)
    assert set(next(iter(given.values()))) == {8 * 2, 4 * 2}, given
    step1 = {row["step"]: row for row in hf}[1], {row["step"]: row for row in deep}[1]
    # After validation's session the HF engine still holds the initial weights; the deep-sleeping one dropped them,
    # and its rollout worker pushed them again before step 1 generated.
    assert "timing_s/update_weights" not in step1[0]
    assert "timing_s/update_weights" in step1[1]


class TwoCallLoop(OneSessionLoop):
    """The loop recipe (`OneSessionLoop` gives it the rest of the protocol: it keeps nothing between calls): one engine session, the prompts generated in two `generate` calls (a first half, then the
    rest), as a loop that feeds the engines in waves would. Each prompt keeps the seed of its index in the whole
    batch (`seeded_request` before the split), so the rows are the single-turn loop's."""

    def run(self, engines: EngineSession, prompts: Batch, params: SamplingParams) -> tuple[Batch, dict[str, float]]:
        request = seeded_request(prompts, params)
        timings = engines.open_rollout()  # one wake, one push for both calls
        half = (len(request) + 1) // 2
        first = engines.generate(request.slice(0, half), params)
        rest = engines.generate(request.slice(half, len(request)), params)
        timings |= engines.close_rollout()
        timings["rollout/generate_calls"] = 2.0
        return with_prompts(prompts, Batch.concat([first, rest]), params), timings


def test_a_new_rollout_loop_plugs_into_the_trainer_and_trains_like_the_single_turn_loop(
    tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    single, _, _ = train_steps(tmp_path / "single", tiny_model_dir, digits_data, {}, steps=2)
    # the recipe's one line: the producer (`easyrl.rollout.producer.build_rollout_loop`, which the trainer reaches
    # through `trainer.resolve.rollout_loop`) returns the new loop
    monkeypatch.setattr("easyrl.trainer.trainer.rollout_loop", lambda cfg, *sources: TwoCallLoop())
    waves, _, _ = train_steps(tmp_path / "waves", tiny_model_dir, digits_data, {}, steps=2)
    assert [row.pop("rollout/generate_calls") for row in waves] == [2.0, 2.0]  # the trainer ran the new loop
    _assert_same_training(waves, single)
    assert [row["rollout/policy_version_max"] for row in waves] == [0.0, 1.0]
