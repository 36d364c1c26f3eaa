"""The reference backend: plain PyTorch, any torch device; the numerical oracle and the default."""
