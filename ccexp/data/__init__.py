"""Corpora: readers, the embedded default corpus, the held-out split, tokenization and packing."""
