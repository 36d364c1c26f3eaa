"""The Hydra config tree, shipped as package data (``pkg://inferhal.conf``)."""
