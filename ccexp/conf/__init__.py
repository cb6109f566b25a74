"""The configs shipped inside the package: ``python -m ccexp`` composes them through ``pkg://ccexp.conf``."""
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent  # the shipped configs (pkg://ccexp.conf), for compose()
