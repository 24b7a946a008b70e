"""easyrl: reinforcement-learning post-training for LLMs and vision-language models."""

__version__ = "0.1.0"
