"""Huawei Ascend 950 backend: torch-npu fused operators, triton-ascend kernels, HCCL.

torch_npu may be initialised only once per process, so nothing here imports it at module import.
"""
