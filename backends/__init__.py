"""In-tree backends. Each registers through the ``inferhal.backends`` entry-point group exactly as an
out-of-tree backend does, and each has the same files: plugin.py (hookimpls only), device.py, ops.py, comm.py."""
