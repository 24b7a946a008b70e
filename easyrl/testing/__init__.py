"""Helpers for tests and demos: tiny, locally built models and tokenizers (see `easyrl.testing.tiny`)."""
