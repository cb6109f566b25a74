"""Clusterers: FAISS k-means over document embeddings."""
