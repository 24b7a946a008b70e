"""The SFT recipe (configs/sft_qwen2_5_1_5b_ultrachat.yaml) passes `easyrl check` with the network off, its hub model
and dataset swapped for local stand-ins laid out as the hub repos are (`data/<split>-*.parquet`)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from easyrl.config import load_config
from easyrl.config.loader import config_task
from tests.conftest import REPO


RECIPE = REPO / "configs" / "sft_qwen2_5_1_5b_ultrachat.yaml"


def _ultrachat_like(root: Path) -> Path:
    """A folder shaped like HuggingFaceH4/ultrachat_200k: `prompt`, `prompt_id` and multi-turn `messages` columns,
    parquet shards per split (the sft splits and a generation split the recipe must not read)."""

    def conversation(i: int) -> dict:
        turns = [("user", f"Tell me about {i}."), ("assistant", f"{i} is a number."), ("user", "More?"),
                 ("assistant", f"{i} + 1 = {i + 1}.")]  # fmt: skip
        return {"prompt": turns[0][1], "prompt_id": str(i), "messages": [{"role": r, "content": c} for r, c in turns]}

    rows = [conversation(i) for i in range(256)]
    for split, part in (("train_sft", rows), ("test_sft", rows[:16]), ("train_gen", rows[:3])):
        path = root / "data" / f"{split}-00000-of-00001.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(part), path)
    return root


def test_sft_recipe_passes_check_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from easyrl.check import run_sft_check
    from easyrl.testing.tiny import build_tiny_checkpoint

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may be fetched
    raw = yaml.safe_load(RECIPE.read_text())
    assert raw["worker"]["actor"]["model"]["model_path"] == "Qwen/Qwen2.5-1.5B-Instruct"
    assert raw["data"]["train_files"].startswith("HuggingFaceH4/ultrachat_200k@")
    model = build_tiny_checkpoint(tmp_path / "model", num_heads=2, num_kv_heads=1, max_position_embeddings=8192)
    data = _ultrachat_like(tmp_path / "ultrachat")
    overrides = [
        f"worker.actor.model.model_path={model}",
        f"data.train_files={data}@train_sft",
        f"data.val_files={data}@test_sft",
        "trainer.device=auto",
    ]
    assert config_task(RECIPE, overrides) == "sft"
    cfg = load_config(RECIPE, overrides, task="sft")
    out = io.StringIO()
    with redirect_stdout(out):
        code = run_sft_check(cfg)
    text = out.getvalue()
    assert code == 0, text[-3000:]
    assert "train: 256 usable conversations" in text and "val: 16 usable conversations" in text
    # both assistant turns of the first conversation train, the user turns do not
    assert "[[0 is a number.<|im_end|>]]" in text and "[[0 + 1 = 1.<|im_end|>]]" in text
    assert "<|im_start|>user\nMore?<|im_end|>" in text
    assert "128 rows per step" in text and "16 rows per worker" in text
    json.dumps(cfg.data.chat_template_kwargs)  # a plain mapping, as the template takes it
