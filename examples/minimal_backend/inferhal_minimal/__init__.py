"""inferhal-minimal-backend: the smallest complete inferhal backend (see docs/backends.md)."""
