"""Diffusion RL (docs/diffusion.md): flow-matching image and video generators trained with GRPO-style updates.

`tiny` builds a tiny Stable-Diffusion-3-style pipeline in code for tests and the CPU demo, as `easyrl.testing`
builds tiny LLMs.
"""
