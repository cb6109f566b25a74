"""Launching: the Hydra launchers (local, packed, Slurm), packing of jobs onto devices, the sweep callback
that records each multirun and its arms, and resuming what a stopped run or sweep left."""
