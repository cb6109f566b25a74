"""Evaluation: held-out perplexity overall, per cluster and per label."""
