"""ccexp's Hydra launcher plugins (Hydra finds launchers in the ``hydra_plugins`` namespace only)."""
