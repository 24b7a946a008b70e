"""A tiny Stable-Diffusion-3-style pipeline built in code: the diffusion counterpart of `easyrl.testing.tiny`.

Tests and the CPU demo need a real diffusers pipeline folder (``model_index.json`` and one folder per component) that
`DiffusionPipeline.from_pretrained` loads, but nothing may be downloaded at run time. `build_tiny_sd3_pipeline`
writes one with random weights:

* ``transformer``: `SD3Transformer2DModel` (an MMDiT: text and image tokens in joint attention), 2 layers, width 32;
* ``vae``: `AutoencoderKL` with three blocks, so images of ``4 * latent_size`` pixels (32 by default) map to
  ``latent_size`` x ``latent_size`` latents with 4 channels; random, or with ``colour_decoder`` a decoder that
  reads latent channels 0-2 as red, green and blue (the demo's: what a policy does to the latents shows);
* ``text_encoder``/``text_encoder_2``: two tiny `CLIPTextModelWithProjection` models sharing one character-level
  CLIP tokenizer (no merges: each character is a token, so any prompt tokenizes without a trained vocabulary);
* ``text_encoder_3``: a one-layer `T5EncoderModel` with a character-level tokenizer (SD3's third encoder; its
  sequence length is the pipeline call's ``max_sequence_length``, so callers keep it short);
* ``scheduler``: `FlowMatchEulerDiscreteScheduler` with SD3's shift of 3.

Every size is an argument so tests can make it smaller still; the defaults keep one 32x32 image's full sampling
(8 steps, both guidance branches) well under a second on one CPU core.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


__all__ = ["build_tiny_sd3_pipeline", "make_clip_tokenizer", "make_t5_tokenizer"]

_START, _END = "<|startoftext|>", "<|endoftext|>"


def _byte_symbols() -> list[str]:
    """The 256 byte-level symbols CLIP's tokenizer maps bytes to, in byte order (GPT-2's reversible mapping)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = [], 0
    for byte in range(256):
        if byte in kept:
            out.append(chr(byte))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def make_clip_tokenizer(max_length: int = 16) -> Any:  # a transformers.CLIPTokenizer (imported lazily: heavy)
    """A character-level CLIP tokenizer: every byte symbol alone and word-final (``x</w>``), and the two specials.

    CLIP's BPE marks the last piece of each word with ``</w>``; with no merges every piece is one character, so the
    vocabulary needs each symbol in both forms. ``max_length`` becomes ``model_max_length``, which SD3 pipelines use
    as the CLIP sequence length (77 in the real models).
    """
    from transformers import CLIPTokenizer

    symbols = _byte_symbols()
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    vocab.update({symbol + "</w>": len(symbols) + i for i, symbol in enumerate(symbols)})
    vocab[_START] = len(vocab)
    vocab[_END] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def make_t5_tokenizer() -> Any:  # a transformers.T5Tokenizer
    """A character-level T5 (Unigram) tokenizer: the printable ASCII characters, each with the same score."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(chr(code), -2.0) for code in range(ord("!"), ord("~") + 1)]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def _tiny_vae(latent_size: int) -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,  # three blocks: two downsamples, images 4x the latents
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 8, 8),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=4 * latent_size,
        # SD3 normalises latents with a shift and a scale; 0 and 1 keep the tiny VAE's latents as they are.
        scaling_factor=1.0,
        shift_factor=0.0,
        mid_block_add_attention=False,
    )


@torch.no_grad()
def _make_colour_decoder(vae: Any) -> None:
    """Set ``vae``'s decoder so latent channels 0, 1 and 2 read as red, green and blue (channel 3 is ignored).

    A randomly initialised decoder is nearly blind to its input: its GroupNorms and a dozen random convolutions wash
    the latents out, so a whole standard deviation of shift in a latent channel moves the image's mean pixel by under
    1%, and no policy over the latents can change what a brightness or colour reward sees. Here every residual
    branch is zeroed (each block is the identity) and each upsampler's convolution copies its input, so the image is
    the latents, upsampled, through the last GroupNorm and convolution: ``conv_in`` writes latent channel c as the
    pair (+l_c, -l_c) of group c, the group norm then holds l_c / rms(l_c) over the image (the pair's mean is 0),
    and ``conv_out`` returns silu(u) - silu(-u) = u as colour c. A pixel's colour c is thus its latent c over the
    image's root mean square of latent c, in [-1, 1] after clamping: a channel that is positive everywhere is full
    colour, pure noise is grey on average.
    """
    dec = vae.decoder
    if vae.post_quant_conv is not None:  # the 1x1 convolution the latents pass before the decoder: the identity
        vae.post_quant_conv.weight.copy_(torch.eye(4).reshape(4, 4, 1, 1))
        vae.post_quant_conv.bias.zero_()
    for module in dec.modules():
        if module.__class__.__name__ == "ResnetBlock2D":  # out = (x + conv2(...)) / 1: zero conv2 -> identity
            module.conv2.weight.zero_()
            module.conv2.bias.zero_()
        if module.__class__.__name__ == "Upsample2D" and module.conv is not None:
            module.conv.weight.zero_()
            module.conv.bias.zero_()
            for ch in range(module.conv.weight.shape[0]):
                module.conv.weight[ch, ch, 1, 1] = 1.0
    width = dec.conv_in.weight.shape[0]
    groups = dec.conv_norm_out.num_groups
    if width != 2 * groups or groups < 3:
        raise ValueError(f"a colour decoder needs 2 channels per group and at least 3 groups, got {width}/{groups}")
    for conv in (dec.conv_in, dec.conv_out):
        conv.weight.zero_()
        conv.bias.zero_()
    dec.conv_norm_out.weight.fill_(1.0)
    dec.conv_norm_out.bias.zero_()
    for c in range(4):
        dec.conv_in.weight[2 * c, c, 1, 1] = 1.0
        dec.conv_in.weight[2 * c + 1, c, 1, 1] = -1.0
    for c in range(3):
        dec.conv_out.weight[c, 2 * c, 1, 1] = 1.0
        dec.conv_out.weight[c, 2 * c + 1, 1, 1] = -1.0


def _tiny_clip(tokenizer: Any, text_width: int, max_length: int) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=text_width,
        intermediate_size=2 * text_width,
        num_hidden_layers=2,  # SD3 reads the penultimate layer's hidden states
        num_attention_heads=2,
        max_position_embeddings=max_length,
        projection_dim=text_width,
        bos_token_id=tokenizer.convert_tokens_to_ids(_START),
        eos_token_id=tokenizer.convert_tokens_to_ids(_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(_END),
    )
    return CLIPTextModelWithProjection(config).eval()


def build_tiny_sd3_pipeline(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    latent_size: int = 8,
    width: int = 32,
    heads: int = 2,
    layers: int = 2,
    text_width: int = 16,
    max_length: int = 16,
    colour_decoder: bool = False,
) -> str:
    """Write a tiny SD3 pipeline folder at ``path`` (random weights from ``seed``) and return the path.

    The transformer's width is ``width`` (= ``heads`` x head dim); the two CLIP encoders have hidden size and
    projection ``text_width`` each, so the joint text features and the pooled projection are ``2 * text_width`` wide,
    which is what SD3 concatenates them to. ``colour_decoder`` sets the VAE's decoder so the first three latent
    channels read as red, green and blue (`_make_colour_decoder`; the demo's pipeline): a random decoder hardly
    responds to its latents, so no reward on the pixels could be learned through it.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import T5Config, T5EncoderModel

    if width % heads:
        raise ValueError(f"build_tiny_sd3_pipeline: width {width} is not a multiple of heads {heads}")
    torch.manual_seed(seed)
    tokenizer = make_clip_tokenizer(max_length)
    t5_tokenizer = make_t5_tokenizer()
    joint = 2 * text_width
    transformer = SD3Transformer2DModel(
        sample_size=latent_size,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=layers,
        attention_head_dim=width // heads,
        num_attention_heads=heads,
        joint_attention_dim=joint,
        caption_projection_dim=width,
        pooled_projection_dim=joint,
        pos_embed_max_size=latent_size,
    )
    vae = _tiny_vae(latent_size)
    if colour_decoder:  # draws no random numbers: the other components' weights are those of the plain build
        _make_colour_decoder(vae)
    pipeline: Any = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=vae,
        text_encoder=_tiny_clip(tokenizer, text_width, max_length),
        tokenizer=tokenizer,
        text_encoder_2=_tiny_clip(tokenizer, text_width, max_length),
        tokenizer_2=tokenizer,
        # A real (tiny) T5: SD3 folders without one load only when the caller passes text_encoder_3=None, and a merged
        # folder must load with a plain `DiffusionPipeline.from_pretrained(path)`.
        text_encoder_3=T5EncoderModel(
            T5Config(vocab_size=len(t5_tokenizer), d_model=joint, d_kv=8, d_ff=2 * joint, num_layers=1, num_heads=2)
        ).eval(),
        tokenizer_3=t5_tokenizer,
    )
    Path(path).mkdir(parents=True, exist_ok=True)
    pipeline.save_pretrained(str(path), safe_serialization=True)
    return str(path)
