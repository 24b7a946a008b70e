"""The checks both Omni thinkers pass (tests/models/test_omni.py, test_qwen3_omni.py): left-padded rows against
themselves alone, packed rows against padded ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from easyrl.batch import Batch
from easyrl.config import DataConfig
from easyrl.testing.tiny_omni import write_tone_wav


def assert_padded_rows_equal_each_alone(model: torch.nn.Module, items: list[dict[str, Any]]) -> dict[str, Any]:
    """Left-pad the dataset `items` into one batch; each row's logits equal its own unpadded forward. Returns the
    batch (`input_ids`, `attention_mask`, `multi_modal_inputs`)."""
    from easyrl.models import multimodal_forward_kwargs

    width = max(len(it["prompt_ids"]) for it in items)
    ids = torch.tensor([[0] * (width - len(it["prompt_ids"])) + it["prompt_ids"] for it in items])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(it["prompt_ids"]) for it in items])[:, None]).long()
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "multi_modal_inputs": [it["multi_modal_inputs"] for it in items],
    }
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, **multimodal_forward_kwargs(batch, model)).logits
        for row, item in enumerate(items):
            alone_ids = torch.tensor([item["prompt_ids"]])
            one = {"input_ids": alone_ids, "attention_mask": torch.ones_like(alone_ids)}
            media = multimodal_forward_kwargs({**one, "multi_modal_inputs": [item["multi_modal_inputs"]]}, model)
            alone = model(**one, **media).logits[0]
            torch.testing.assert_close(logits[row, mask[row].bool()], alone, rtol=1e-4, atol=1e-4)
    return batch


def omni_batch(model_dir: str, folder: Path) -> Batch:
    """A micro-batch of four rows through the thinker's processor (a short clip; text only; a longer clip mid-prompt;
    an image and a clip), each with a response of its own length, left-padded."""
    from PIL import Image

    from easyrl.data.dataset import RLDataset
    from easyrl.models import load_processor

    write_tone_wav(folder / "a.wav", 0.5, 8000)
    write_tone_wav(folder / "b.wav", 1.2, 22050)
    Image.new("RGB", (48, 32), (200, 30, 90)).save(folder / "c.png")
    rows = [{"prompt": "<audio>Tone?", "answer": "1", "audios": ["a.wav"]}, {"prompt": "Words only.", "answer": "1"},
            {"prompt": "And <audio> this?", "answer": "1", "audios": ["b.wav"]},
            {"prompt": "See <image> and hear <audio>.", "answer": "1", "images": ["c.png"], "audios": ["a.wav"]}]  # fmt: skip
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(
        train_files=str(folder / "rows.jsonl"), audio_dir=str(folder), image_dir=str(folder),
        max_prompt_length=256, min_pixels=32 * 32, max_pixels=64 * 64,
    )  # fmt: skip
    data = RLDataset(cfg.train_files, cfg, None, load_processor(model_dir))
    items = [data[i] for i in range(4)]
    assert items[3]["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 6]]  # 48x32: 6 image tokens
    responses = ["abcde", "xyz", "1234", "ab"]
    p, r = max(len(i["prompt_ids"]) for i in items), 5
    ids, mask = torch.full((4, p + r), 256), torch.zeros(4, p + r, dtype=torch.long)
    for row, (item, text) in enumerate(zip(items, responses)):
        n = len(item["prompt_ids"])
        ids[row, p - n : p] = torch.tensor(item["prompt_ids"])
        ids[row, p : p + len(text)] = torch.tensor([ord(c) for c in text])
        mask[row, p - n : p + len(text)] = 1
    return Batch(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
         "responses": ids[:, p:], "response_mask": mask[:, p:].clone()},
        {"multi_modal_inputs": [item["multi_modal_inputs"] for item in items]},
    )  # fmt: skip


def assert_packed_rows_give_the_padded_log_probs_and_gradients(
    model_dir: str, folder: Path, parts: tuple[str, ...]
) -> None:
    """Four rows (a short clip; text only; a longer clip mid-prompt; an image and a clip), padded against packed
    through the fused head (the thinker's own forward with an identity head, then the chunked head): log-probs and every
    gradient, with the parameters named by each of `parts` among those that get one; then the same for the thinker's
    critic (values and gradients)."""
    from easyrl.config import ModelConfig
    from easyrl.workers.forward_backward import response_values, token_log_probs
    from easyrl.workers.model_setup import load_model
    from easyrl.workers.packing import packed_attn_implementation
    from easyrl.workers.specs import ForwardOptions

    mb = omni_batch(model_dir, folder)

    def loss_grads(model: torch.nn.Module, opts: ForwardOptions | None) -> tuple[torch.Tensor, dict]:
        model.zero_grad(set_to_none=True)
        lp, ent = token_log_probs(model, mb, torch.device("cpu"), 0.8, with_entropy=True, opts=opts)
        assert ent is not None
        ((lp + 0.1 * ent) * mb["response_mask"]).sum().backward()
        return lp.detach(), {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}

    padded = load_model(ModelConfig(model_path=model_dir), "causal_lm").train()
    packed_attn = packed_attn_implementation()
    packed = load_model(ModelConfig(model_path=model_dir), "causal_lm", attn_implementation=packed_attn).train()
    ref, ref_grads = loss_grads(padded, None)
    for part in parts:
        assert any(n.startswith(part) for n in ref_grads), part
    head_calls: list[int] = []  # the fused head runs the thinker's forward with an identity head: no (T, V) logits
    hook = packed.get_output_embeddings().register_forward_hook(lambda *_: head_calls.append(1))
    lp, grads = loss_grads(packed, ForwardOptions(padding_free=True, fused=True))
    hook.remove()
    assert not head_calls, "the fused setting computed the thinker's full logits"
    m = mb["response_mask"].bool()
    torch.testing.assert_close(lp[m], ref[m], atol=1e-5, rtol=0)
    _assert_same_grads(grads, ref_grads)

    # The thinker's critic (`ThinkerValueModel`): the same rows give the same values and gradients packed as padded,
    # and its value head reads the thinker's hidden states with the audio merged in (the audio tower gets gradients).
    def value_grads(model: torch.nn.Module, opts: ForwardOptions | None) -> tuple[torch.Tensor, dict]:
        model.zero_grad(set_to_none=True)
        values = response_values(model, mb, torch.device("cpu"), opts)
        (values * mb["response_mask"]).sum().backward()
        return values.detach(), {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}

    torch.manual_seed(0)  # the same value head in both (it is new, not in the checkpoint)
    padded = load_model(ModelConfig(model_path=model_dir), "value").train()
    torch.manual_seed(0)
    packed = load_model(ModelConfig(model_path=model_dir), "value", attn_implementation=packed_attn).train()
    assert not any("lm_head" in n for n, _ in packed.named_parameters())  # no (V, H) head under the value head
    ref, ref_grads = value_grads(padded, None)
    assert any(n.startswith("model.audio_tower.") for n in ref_grads) and "score.weight" in ref_grads
    values, grads = value_grads(packed, ForwardOptions(padding_free=True))
    torch.testing.assert_close(values[m], ref[m], atol=1e-5, rtol=0)
    _assert_same_grads(grads, ref_grads)


def _assert_same_grads(grads: dict[str, torch.Tensor], ref_grads: dict[str, torch.Tensor]) -> None:
    assert grads.keys() == ref_grads.keys()
    for name, expected in ref_grads.items():
        torch.testing.assert_close(grads[name], expected, atol=1e-5, rtol=1e-4, msg=name)
