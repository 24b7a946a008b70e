"""The last-colour task: synthetic long videos whose answer sits near their end, and a tiny VL model to learn it.

Each video is ``frames`` (>= 1,000) small frames of solid colours: a run of distractor segments of random colours
and lengths, then a final segment (the last ``tail`` frames) of a colour different from the one before it. The
answer is that last colour's letter (``R``, ``G``, ``B`` or ``Y``: one token of the tiny character-level tokenizer).
Every colour appears among the distractors, so neither the first frames nor the commonest colour gives the answer:
a policy beats 1 in 4 only by reading the end of the clip. Frame sampling keeps the last frame (`data.video_fps`
evenly from first to last frame), so the final segment is always in the sampled clip.

    python -m easyrl.testing.long_video assets/demo_long_video     # then: easyrl train configs/demo_long_video.yaml

writes ``train.jsonl``, ``val.jsonl``, ``videos/`` and ``model/`` there. The model is a random-init tiny
Qwen2.5-VL whose head is warm-started on the format, not the answer: the four letters' output rows are set to the mean
final hidden state at the answer position of the training prompts (scaled to a logit of `FORMAT_LOGIT`), so the
untrained policy answers with a colour letter nine times in ten, each letter alike (a reward of about 0.25). From a
fully random head a letter comes 4 times in 267 and GRPO's groups of 8 almost never see a reward to learn from.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import numpy as np


__all__ = ["COLOURS", "PROMPT", "build_last_colour_task", "colour_segments", "write_colour_video"]

COLOURS: dict[str, tuple[int, int, int]] = {
    "R": (220, 30, 30),
    "G": (30, 200, 30),
    "B": (30, 30, 220),
    "Y": (230, 220, 30),
}
"""The colours, by the letter that answers for them, and their RGB."""
PROMPT = "<video>Which colour is last?"
"""The question of every row (the video first, so that its end is the nearest media to the answer). The letters are
not in it: the warm start changes their (tied) embeddings, which must not move the hidden states it measures."""
DATA = {"video_fps": 2.0, "max_frames": 8, "min_pixels": 32 * 32, "max_pixels": 128 * 128, "max_prompt_length": 160}
"""The `data.*` settings of configs/demo_long_video.yaml: 8 frames of each 1,000, 32x32, 4 tokens a temporal patch."""
FORMAT_LOGIT = 7.0
"""The letters' logit over the others' (about 0) after the warm start: 4 e^7 / (4 e^7 + 263) ~ 0.94."""


def colour_segments(rng: random.Random, frames: int, tail: int) -> list[tuple[str, int]]:
    """(colour letter, frame count) runs summing to `frames`: distractors of 40-160 frames covering every colour,
    then `tail` frames of a last colour unlike the distractor before it."""
    letters = list(COLOURS)
    segments: list[tuple[str, int]] = []
    left = frames - tail
    while left > 0:
        # cycle through a shuffled palette so each colour shows up before the end
        order = rng.sample(letters, len(letters))
        for letter in order:
            if left <= 0:
                break
            if segments and segments[-1][0] == letter:
                continue
            length = min(left, rng.randint(40, 160))
            segments.append((letter, length))
            left -= length
    last = rng.choice([c for c in letters if c != segments[-1][0]])
    segments.append((last, tail))
    return segments


def write_colour_video(path: Path, segments: list[tuple[str, int]], fps: int = 25, size: int = 32) -> None:
    """An mpeg4 video of solid-colour frames, `segments` in order, `size` x `size` pixels."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size, size, "yuv420p"
        for letter, count in segments:
            frame = av.VideoFrame.from_ndarray(np.full((size, size, 3), COLOURS[letter], np.uint8), format="rgb24")
            for _ in range(count):
                for packet in stream.encode(frame):
                    container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _rows(folder: Path, count: int, frames: int, tail: int, seed: int, split: str) -> list[dict[str, Any]]:
    rng = random.Random(f"{seed}-{split}")
    rows = []
    for i in range(count):
        segments = colour_segments(rng, frames, tail)
        name = f"{split}_{i:04d}.mp4"
        write_colour_video(folder / "videos" / name, segments)
        rows.append({"prompt": PROMPT, "answer": segments[-1][0], "videos": [name]})
    return rows


def build_last_colour_task(
    folder: str | Path,
    train: int = 64,
    val: int = 16,
    frames: int = 1000,
    tail: int = 150,
    seed: int = 0,
    **model_kwargs: Any,
) -> dict[str, str]:
    """Write the task into `folder` (videos, train/val jsonl, a tiny Qwen2.5-VL built with `model_kwargs`); returns
    their paths."""
    from easyrl.testing.tiny_vl import build_tiny_vl_checkpoint

    if frames < 2 * tail:
        raise ValueError(f"frames ({frames}) must be at least twice the tail ({tail}): the end must be near the end")
    root = Path(folder)
    (root / "videos").mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, count in (("train", train), ("val", val)):
        rows = _rows(root, count, frames, tail, seed, split)
        paths[split] = str(root / f"{split}.jsonl")
        Path(paths[split]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    # 32x32 frames are 4x4 patches of 8 pixels: 4 merged tokens a temporal patch
    paths["model"] = build_tiny_vl_checkpoint(
        root / "model", arch="qwen2_5_vl", seed=seed, min_pixels=32 * 32, **model_kwargs
    )
    _warm_start_format(paths["model"], paths["train"], root / "videos")
    paths["videos"] = str(root / "videos")
    return paths


def _warm_start_format(model_dir: str, rows_file: str, videos: Path, prompts: int = 16) -> None:
    """Set the letters' output rows so that the model answers with some colour letter (see the module docstring)."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForImageTextToText

    from easyrl.data.multimodal import encode_multimodal_prompt
    from easyrl.models import load_processor

    processor = load_processor(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    data_cfg = SimpleNamespace(limit_images=0, **DATA)
    hidden = []
    rows = [json.loads(line) for line in Path(rows_file).read_text().splitlines()[:prompts]]
    with torch.no_grad():
        for row in rows:
            messages = [{"role": "user", "content": row["prompt"]}]
            enc = encode_multimodal_prompt(processor, messages, [], [str(videos / row["videos"][0])], data_cfg)
            out = model(
                input_ids=torch.tensor([enc["input_ids"]]), **enc["multi_modal_inputs"], output_hidden_states=True
            )
            hidden.append(out.hidden_states[-1][0, -1])  # after the final norm: what the head reads
        states = torch.stack(hidden)
        mean = states.mean(0)
        ids = [processor.tokenizer.convert_tokens_to_ids(letter) for letter in COLOURS]
        head = model.get_output_embeddings().weight
        head[ids] = FORMAT_LOGIT / float((states @ mean).mean()) * mean
    model.save_pretrained(model_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--train", type=int, default=64)
    parser.add_argument("--val", type=int, default=16)
    parser.add_argument("--frames", type=int, default=1000)
    args = parser.parse_args(argv)
    for what, path in build_last_colour_task(args.folder, args.train, args.val, args.frames).items():
        print(f"{what}: {path}")


if __name__ == "__main__":
    main()
