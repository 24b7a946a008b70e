"""What the reward function is given for a batch of rows, picked once by the run plan (`RunPlan.modality`): the one
place where a text run and a diffusion run score differently, so `Trainer.score_rows` reads the same for both.

* text (`text_reward_inputs`): the decoded responses, EasyR1's inputs (`response`, `response_length`, ...);
* diffusion (`image_reward_inputs`): the decoded images the engine returned under ``images``, one H x W x 3 uint8
  numpy array (RGB) per row under `image` (docs/diffusion.md); the rows' "texts" are empty (an image has none).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from easyrl.batch import Batch


RewardInputs = Callable[[Batch], tuple[list[dict[str, Any]], list[str]]]
"""A batch of rows -> (one reward input per row, the rows' decoded texts)."""


def text_reward_inputs(
    batch: Batch, tokenizer: Any, skip_special_tokens: bool
) -> tuple[list[dict[str, Any]], list[str]]:
    """Decode the responses (up to their lengths) and build EasyR1's reward inputs."""
    lengths = batch["response_mask"].sum(dim=1).tolist()
    texts = tokenizer.batch_decode(
        [r[: int(n)] for r, n in zip(batch["responses"].tolist(), lengths)], skip_special_tokens=skip_special_tokens
    )
    inputs = [
        {**row, "prompt": prompt, "response": text, "response_length": int(n), "ground_truth": gt}
        for row, prompt, text, n, gt in zip(batch["row"], batch["raw_prompt"], texts, lengths, batch["ground_truth"])
    ]
    return inputs, texts


def image_reward_inputs(batch: Batch) -> tuple[list[dict[str, Any]], list[str]]:
    """The row's columns plus `prompt` (the text the pipeline encoded), `image` and `ground_truth`."""
    inputs = [
        {**row, "prompt": prompt, "image": image, "ground_truth": gt}
        for row, prompt, image, gt in zip(batch["row"], batch["raw_prompt"], batch["images"], batch["ground_truth"])
    ]
    return inputs, [""] * len(inputs)


SampleWriter = Callable[[Batch, int, int, int], None]
"""(validation rows, step, index of the call's first prompt, samples per prompt) -> None."""


def validation_samples_for(modality: str, run_dir: str | None) -> SampleWriter | None:
    """What keeps a validation call's samples beside the run: a diffusion run's images as
    ``<run_dir>/samples/step_<k>/<prompt>_<sample>.png`` with ``prompts.json`` (`easyrl.report_samples`, the report's
    grids); None for text (the generations table logs those) or without a run folder."""
    if modality != "diffusion" or not run_dir:
        return None
    from easyrl.report_samples import write_step

    def write(batch: Batch, step: int, first_prompt: int, n: int) -> None:
        write_step(run_dir, step, list(batch["images"]), list(batch["raw_prompt"]), n, first_prompt)

    return write


def reward_inputs_for(modality: str, tokenizer: Any, skip_special_tokens: bool) -> RewardInputs:
    """The reward inputs of this run's rows (`RunPlan.modality`)."""
    if modality == "diffusion":
        return image_reward_inputs
    return partial(text_reward_inputs, tokenizer=tokenizer, skip_special_tokens=skip_special_tokens)
