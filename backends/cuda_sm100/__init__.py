"""NVIDIA Blackwell backend (SM100/SM103; SM90 degraded): Triton kernels from inferhal.kernels, cuda-python."""
