"""Speculative decoding drafters (device-agnostic: token ids in, draft token ids out)."""
