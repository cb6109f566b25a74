"""Experiment tracking: MLflow runs and stores (local, SQLite, a server), and the extra loggers (TensorBoard,
W&B, CSV)."""
