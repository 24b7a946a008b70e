"""Diffusion RL (docs/diffusion.md): flow-matching image and video generators trained with GRPO-style updates.

`tiny` builds a tiny Stable-Diffusion-3-style pipeline in code for tests and the CPU demo, as `easyrl.testing`
builds tiny LLMs; `policy` scores recorded denoising transitions under the transformer's current weights (the
Flow-GRPO math itself is `easyrl.algorithms.flow_grpo`); `actor` holds the denoiser's actor and reference workers.
"""
