"""Device kernels: Triton sources (shared by cuda_sm100 and, where they compile, triton-ascend) and CUDA C
compiled at run time through NVRTC. Each kernel is a pure function of tensors and a frozen params
dataclass, with its reference op in backends/reference and its test in tests/kernels/."""
