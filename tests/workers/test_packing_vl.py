"""Vision-language rows on the padding-free packed path and the fused head: the padded path's log-probs, entropies,
gradients and values, on tiny Qwen2.5-VL and Qwen3-VL models with images, a video and a text-only row."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from easyrl.batch import Batch
from easyrl.config import ModelConfig
from easyrl.data.multimodal import encode_multimodal_prompt
from easyrl.models import load_processor, mrope_position_ids, stack_media
from easyrl.models.vl_sequence import split_after_embeddings
from easyrl.testing.tiny_vl import VL_ARCHS, build_tiny_vl_checkpoint
from easyrl.workers.forward_backward import batched_log_probs, response_values, token_log_probs
from easyrl.workers.model_setup import load_model
from easyrl.workers.packing import packed_attn_implementation, prepare_inputs
from easyrl.workers.specs import ForwardOptions
from easyrl.workers.varlen import VARLEN_ATTENTION


CPU = torch.device("cpu")
DATA_CFG = SimpleNamespace(min_pixels=16 * 16, max_pixels=32 * 32, video_fps=2.0, max_frames=4, limit_images=0)
RESPONSES = ["abcde", "xyz", "1234"]
"""Right-padded responses of different lengths."""


def _write_video(path: Path) -> None:
    """8 frames at 4 fps (2 s) of a bar sweeping right: 4 sampled frames, 2 temporal patches."""
    av = pytest.importorskip("av")
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(8):
            arr = np.zeros((32, 32, 3), np.uint8)
            arr[:, : (i + 1) * 4] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _batch(processor: Any, video: Path) -> Batch:
    """Three left-padded prompts: one image; a video and an image; text only. Responses right-padded."""
    rows = [
        ("Shape? <image>", [Image.new("RGB", (32, 24), (255, 0, 0))], []),
        ("What moves <video> and this <image>?", [Image.new("RGB", (16, 16), (0, 0, 255))], [str(video)]),
        ("No picture here, just words.", [], []),
    ]
    encoded = [
        encode_multimodal_prompt(processor, [{"role": "user", "content": text}], images, videos, DATA_CFG)
        for text, images, videos in rows
    ]
    p, r = max(len(e["input_ids"]) for e in encoded), max(map(len, RESPONSES))
    ids = torch.full((len(rows), p + r), processor.tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for row, (e, resp) in enumerate(zip(encoded, RESPONSES)):
        n = len(e["input_ids"])
        ids[row, p - n : p] = torch.tensor(e["input_ids"])
        ids[row, p : p + len(resp)] = torch.tensor([ord(c) for c in resp])
        mask[row, p - n : p + len(resp)] = 1
    g = torch.Generator().manual_seed(0)
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "responses": ids[:, p:],
            "response_mask": mask[:, p:].clone(),
            "loss_mask": mask[:, p:].clone(),
            "advantages": torch.randn(len(rows), r, generator=g),
        },
        {"multi_modal_inputs": [e["multi_modal_inputs"] for e in encoded]},
    )


@pytest.fixture(scope="module", params=VL_ARCHS)
def vl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Batch]:
    root = tmp_path_factory.mktemp(f"vl-{request.param}")
    path = build_tiny_vl_checkpoint(root / "model", request.param)
    _write_video(root / "clip.mp4")
    return path, _batch(load_processor(path), root / "clip.mp4")


def _load(path: str, packed: bool, kind: str = "causal_lm") -> Any:
    attn = packed_attn_implementation() if packed else None
    return load_model(ModelConfig(model_path=path), kind, attn_implementation=attn)


def test_packed_layout_carries_media_and_per_sample_mrope(vl: tuple[str, Batch]) -> None:
    path, mb = vl
    model = _load(path, packed=True)
    inputs = prepare_inputs(mb, padding_free=True, model=model)
    mask = mb["attention_mask"].bool()
    t = int(mask.sum())
    assert inputs.position_ids.shape == (4, 1, t) and inputs.media["mm_token_type_ids"].shape == (1, t)
    assert {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"} <= inputs.media.keys()
    text_row = inputs.position_ids[0, 0]
    assert torch.equal(text_row, mb["position_ids"][mask])  # the boundaries: 0 at each sample's first token
    assert int((text_row == 0).sum()) == len(mb)
    # The 3D rows: each sample's own positions, computed on its unpadded tokens alone, back to back.
    own = []
    for row, sample in enumerate(mb["multi_modal_inputs"]):
        ids = mb["input_ids"][row, mask[row]][None]
        media = stack_media([sample])
        grids = (media.get(k) for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts"))
        own.append(mrope_position_ids(model, ids, torch.ones_like(ids), *grids)[:, 0])
    assert torch.equal(inputs.position_ids[1:, 0], torch.cat(own, dim=1))
    assert not torch.equal(inputs.position_ids[1], inputs.position_ids[0])  # vision tokens do move the 3D rows
    with pytest.raises(ValueError, match="vision-language model"):  # no silent layout without the pixels
        prepare_inputs(mb, padding_free=True)


def _loss_grads(model: Any, mb: Batch, opts: ForwardOptions | None) -> tuple[torch.Tensor, ...]:
    model.zero_grad(set_to_none=True)
    lp, ent = token_log_probs(model, mb, CPU, 0.8, with_entropy=True, opts=opts)
    assert ent is not None
    mask = mb["response_mask"].float()
    ((lp * mb["advantages"] + 0.1 * ent) * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), grads  # type: ignore[return-value]


def test_packed_and_fused_log_probs_and_grads_equal_padded(vl: tuple[str, Batch]) -> None:
    path, mb = vl
    padded, packed = _load(path, packed=False).train(), _load(path, packed=True).train()
    assert packed.config.text_config._attn_implementation == VARLEN_ATTENTION  # so a padded row would be refused
    mask = mb["response_mask"].bool()
    ref_lp, ref_ent, ref_grads = _loss_grads(padded, mb, None)
    assert any("visual" in n for n in ref_grads)  # the vision tower is trained: its gradients are compared too
    for opts in (ForwardOptions(padding_free=True), ForwardOptions(padding_free=True, fused=True, chunk_size=5)):
        lp, ent, grads = _loss_grads(packed, mb, opts)
        torch.testing.assert_close(lp[mask], ref_lp[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[mask], ref_ent[mask], atol=1e-5, rtol=0)
        assert torch.all(lp[~mask] == 0)
        assert grads.keys() == ref_grads.keys()
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, atol=1e-5, rtol=1e-4, msg=name)
    # Trimmed padded rows (fused head without packing) with 3D positions; micro-batches split the media by row.
    for opts, model in (
        (ForwardOptions(fused=True, chunk_size=4), padded),
        (ForwardOptions(padding_free=True), packed),
    ):
        lp, _ = batched_log_probs(model.eval(), mb, CPU, 0.8, micro_batch_size=2, opts=opts)
        torch.testing.assert_close(lp[mask], ref_lp[mask], atol=1e-5, rtol=0)


def test_packed_values_equal_padded(vl: tuple[str, Batch]) -> None:
    path, mb = vl
    padded = _load(path, packed=False, kind="value").eval()
    packed = _load(path, packed=True, kind="value").eval()
    packed.load_state_dict(padded.state_dict())  # the value head is freshly initialised at each load
    ref = response_values(padded, mb, CPU)
    assert ref.abs().sum() > 0
    got = response_values(packed, mb, CPU, ForwardOptions(padding_free=True))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_split_after_embeddings_gives_a_slice_of_the_whole_row(vl: tuple[str, Batch]) -> None:
    """The sequence-parallel seam on one process: a slice of the packed row from the second sample's start to the
    middle of its video (an image after the cut, the first sample's image before the slice) gives the whole row's
    logits there, as attention within that sample must: the vision tower ran on the whole row, and the positions
    (and Qwen3-VL's deepstack rows) followed their tokens."""
    path, mb = vl
    model = _load(path, packed=True).eval()
    inputs = prepare_inputs(mb, padding_free=True, model=model)
    start = int((inputs.position_ids[0, 0] == 0).nonzero()[1])
    video_slots = (inputs.input_ids[0] == model.config.video_token_id).nonzero().squeeze(1)
    stop = int(video_slots[len(video_slots) // 2])
    kwargs = {"input_ids": inputs.input_ids, "position_ids": inputs.position_ids, "use_cache": False, **inputs.media}
    whole = model(**kwargs).logits

    def one_slice(seq: dict[str, tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
        return {k: t.narrow(dim, start, stop - start) for k, (t, dim) in seq.items()}

    with split_after_embeddings(model, one_slice):
        part = model(**kwargs).logits
    assert part.shape[1] == stop - start
    torch.testing.assert_close(part[0], whole[0, start:stop], atol=1e-5, rtol=0)
    assert model(**kwargs).logits.shape == whole.shape  # the hook is gone after the block
