"""The sample grids of a diffusion run's HTML report: each validation prompt's images, first validation vs last.

The layout the rollout of a diffusion run writes at each validation (docs/diffusion.md):
``<run>/samples/step_<k>/<prompt_idx>_<sample_idx>.png`` (``.gif`` for a video's frames), and beside them
``prompts.json``: ``{"<prompt_idx>": "<prompt text>"}``. The report reads the first and the last step folder (before
and after training) and embeds their files, so the page stays self-contained.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
from typing import Any


SAMPLES_DIR = "samples"
_STEP = re.compile(r"^step_(\d+)$")
_SAMPLE = re.compile(r"^(\d+)_(\d+)\.(png|gif)$")


def sample_steps(run_dir: str) -> list[int]:
    """The validation steps that logged samples, in order."""
    root = os.path.join(run_dir, SAMPLES_DIR)
    if not os.path.isdir(root):
        return []
    found = (_STEP.match(name) for name in os.listdir(root))
    return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(root, m.group(0))))


def read_step(run_dir: str, step: int) -> tuple[dict[int, list[str]], dict[int, str]]:
    """({prompt index: its sample files in sample order}, {prompt index: prompt text}) of one validation step."""
    folder = os.path.join(run_dir, SAMPLES_DIR, f"step_{step}")
    files: dict[int, list[tuple[int, str]]] = {}
    for name in os.listdir(folder):
        m = _SAMPLE.match(name)
        if m:
            files.setdefault(int(m.group(1)), []).append((int(m.group(2)), os.path.join(folder, name)))
    prompts: dict[int, str] = {}
    prompts_file = os.path.join(folder, "prompts.json")
    if os.path.isfile(prompts_file):
        with open(prompts_file, encoding="utf-8") as fh:
            prompts = {int(k): str(v) for k, v in json.load(fh).items()}
    return {k: [path for _, path in sorted(v)] for k, v in files.items()}, prompts


def write_step(run_dir: str, step: int, images: list[Any], prompts: list[str], n: int, first_prompt: int) -> str:
    """Write one validation call's samples into ``<run_dir>/samples/step_<step>``: ``images`` (``n`` per prompt, in
    prompt order: H x W x 3 uint8 arrays, or F x H x W x 3 for a video, written as a GIF) of the prompts numbered from
    ``first_prompt``, and their texts added to ``prompts.json`` (a validation set runs in several calls). Returns the
    folder."""
    import numpy as np
    from PIL import Image

    folder = os.path.join(run_dir, SAMPLES_DIR, f"step_{step}")
    os.makedirs(folder, exist_ok=True)
    for row, image in enumerate(images):
        prompt, sample = first_prompt + row // n, row % n
        array = np.asarray(image, dtype=np.uint8)
        if array.ndim == 4:  # a video's frames: one looping GIF
            frames = [Image.fromarray(frame) for frame in array]
            name = os.path.join(folder, f"{prompt}_{sample}.gif")
            frames[0].save(name, save_all=True, append_images=frames[1:], duration=125, loop=0)
        else:
            Image.fromarray(array).save(os.path.join(folder, f"{prompt}_{sample}.png"))
    prompts_file = os.path.join(folder, "prompts.json")
    known: dict[str, str] = {}
    if os.path.isfile(prompts_file):
        with open(prompts_file, encoding="utf-8") as fh:
            known = json.load(fh)
    known |= {str(first_prompt + i): text for i, text in enumerate(prompts[::n])}
    with open(prompts_file, "w", encoding="utf-8") as fh:
        json.dump(known, fh, indent=1)
    return folder


def _img(path: str) -> str:
    kind = "gif" if path.endswith(".gif") else "png"
    with open(path, "rb") as fh:
        data = base64.b64encode(fh.read()).decode("ascii")
    return f'<img class="sample" alt="{html.escape(os.path.basename(path))}" src="data:image/{kind};base64,{data}">'


def samples_section(run_dir: str) -> str:
    """The report's samples section: one row per prompt, its first validation's samples beside its last's; empty
    when the run logged no samples (an LLM run)."""
    steps = sample_steps(run_dir)
    if not steps:
        return ""
    first, last = steps[0], steps[-1]
    before, prompts = read_step(run_dir, first)
    after, later_prompts = read_step(run_dir, last)
    prompts = {**later_prompts, **prompts}
    head = f"<th>prompt</th><th>step {first} (first validation)</th>"
    head += f"<th>step {last} (last validation)</th>" if last != first else ""
    rows = []
    for idx in sorted(set(before) | set(after)):
        cells = [f"<td>{html.escape(prompts.get(idx, f'prompt {idx}'))}</td>"]
        for step_files in (before, after) if last != first else (before,):
            cells.append(f'<td class="grid">{"".join(_img(p) for p in step_files.get(idx, []))}</td>')
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return (
        f'<section id="samples"><h2>Samples</h2><p>Each validation prompt\'s samples, before and after training '
        f'({len(steps)} validations logged samples).</p><table class="samples"><tr>{head}</tr>{"".join(rows)}'
        "</table></section>"
    )
