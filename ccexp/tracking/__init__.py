"""Experiment tracking: MLflow setup, run names and logging helpers."""
