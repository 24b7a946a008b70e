"""The SFT configs: the GPU recipe (configs/sft_qwen2_5_1_5b_ultrachat.yaml) passes `easyrl check` with the network
off, its hub model and dataset swapped for local stand-ins laid out as the hub repos are (`data/<split>-*.parquet`);
the demo's (configs/demo_sft.yaml) trains on the rows `make_demo_assets.py --sft-data` writes, which replay the
warm start's batches token for token: the same prompts, and the answer with its EOS as the only trained tokens; the
copy shipped in assets/demo_sft is that script's output."""

from __future__ import annotations

import importlib.util
import io
import json
import random
import subprocess
import sys
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


def test_demo_sft_data_replays_the_warm_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from easyrl.data.sft import SFTDataset

    script = REPO / "scripts" / "make_demo_assets.py"
    out = tmp_path / "demo_sft"
    proc = subprocess.run(
        [sys.executable, str(script), "--sft-data", str(out), "--sft-steps", "2"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec = importlib.util.spec_from_file_location("make_demo_assets", script)
    assert spec is not None and spec.loader is not None
    assets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(assets)
    rng = random.Random(1 + 1)  # the warm start's generator: seed + 1
    batches = [[assets.make_row(rng) for _ in range(64)] for _ in range(2)]
    monkeypatch.chdir(REPO)
    overrides = [
        f"data.train_files={out / 'train.parquet'}",
        f"data.val_files={out / 'val.jsonl'}",
        f"worker.actor.model.model_path={out / 'init_model'}",
    ]
    cfg = load_config(REPO / "configs" / "demo_sft.yaml", overrides, task="sft")
    train = SFTDataset(cfg.data.train_files, cfg.data, cfg.sft, assets.make_tokenizer())
    assert len(train) == 128
    ids, _, labels = assets.sft_batch(assets.make_tokenizer(), [row for batch in batches for row in batch])
    for i in (0, 1, 63, 64, 127):  # both batches, in the warm start's order
        item = train[i]
        prompt_len = len(item["prompt_ids"])
        trained = [t for t, m in zip(item["response_ids"], item["loss_mask"]) if m]
        assert ids[i, :prompt_len].tolist() == item["prompt_ids"]
        assert labels[i][labels[i] != -100].tolist() == trained  # the answer and its EOS, as the warm start
    assert len((out / "val.jsonl").read_text().splitlines()) == 64
    # the shipped copy (assets/demo_sft, what a fresh clone trains on) is the script's output: its first two batches,
    # 550 steps of them in all, the same validation rows and the same initial weights
    shipped = REPO / "assets" / "demo_sft"
    rows = pq.read_table(shipped / "train.parquet").to_pylist()
    assert len(rows) == 550 * 64
    assert rows[:128] == pq.read_table(out / "train.parquet").to_pylist()
    assert (shipped / "val.jsonl").read_bytes() == (out / "val.jsonl").read_bytes()
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (shipped / "init_model" / name).read_bytes() == (out / "init_model" / name).read_bytes(), name
