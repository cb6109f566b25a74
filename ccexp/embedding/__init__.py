"""Embedders: map documents to L2-normalised float32 vectors on disk."""
