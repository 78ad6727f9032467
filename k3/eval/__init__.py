"""Evaluating k3 models: log-likelihoods of token sequences (scoring.py), perplexity and bits per byte of a text,
and an lm-evaluation-harness model (harness.py: ``lm_eval --model k3 --model_args checkpoint=DIR``)."""

from .scoring import TextScore, prefix_id, rolling_windows, score_sequences, score_text

__all__ = ["score_sequences", "rolling_windows", "score_text", "TextScore", "prefix_id"]
