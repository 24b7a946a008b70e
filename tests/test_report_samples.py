"""The report's sample grids: a diffusion run's validation images per prompt, first validation beside last, read
from the layout docs/diffusion.md gives (`<run>/samples/step_<k>/<prompt_idx>_<sample_idx>.png` + prompts.json)."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

from PIL import Image

from easyrl.report import build_report
from easyrl.report_samples import samples_section


def _write_step(run: Path, step: int, colour: tuple[int, int, int], prompts: dict[str, str]) -> None:
    folder = run / "samples" / f"step_{step}"
    folder.mkdir(parents=True)
    for idx in prompts:
        for sample in range(2):
            Image.new("RGB", (8, 8), colour).save(folder / f"{idx}_{sample}.png")
    (folder / "prompts.json").write_text(json.dumps(prompts))


def test_grid_shows_each_prompt_first_validation_beside_the_last(tmp_path: Path) -> None:
    run = tmp_path / "run"
    prompts = {"0": "a red square", "1": "a blue <circle>"}
    for step, colour in ((0, (0, 0, 0)), (10, (9, 9, 9)), (20, (255, 0, 0))):
        _write_step(run, step, colour, prompts)
    (run / "experiment_log.jsonl").write_text('{"step": 1, "reward/overall": 0.5}\n')
    page = Path(build_report(str(run))).read_text()
    assert "step 0 (first validation)" in page and "step 20 (last validation)" in page and "step 10" not in page
    assert "a blue &lt;circle&gt;" in page  # prompt text escaped
    rows = re.findall(r"<tr><td>(.*?)</td>(.*?)</tr>", page)
    assert [r[0] for r in rows if "square" in r[0] or "circle" in r[0]] == ["a red square", "a blue &lt;circle&gt;"]
    cells = re.findall(r'<td class="grid">(.*?)</td>', rows[0][1])
    colours = []
    for cell in cells:  # each cell: the prompt's two samples of that step, decoded back to their pixels
        datas = re.findall(r"base64,([A-Za-z0-9+/=]+)", cell)
        assert len(datas) == 2
        with Image.open(io.BytesIO(base64.b64decode(datas[0]))) as image:
            colours.append(image.getpixel((0, 0)))
    assert colours == [(0, 0, 0), (255, 0, 0)]


def test_a_run_without_samples_has_no_samples_section(tmp_path: Path) -> None:
    assert samples_section(str(tmp_path)) == ""
