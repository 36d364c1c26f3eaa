"""Device kernels: Triton sources shared by cuda_sm100 and (where they compile) triton-ascend.

Each kernel module holds ``@triton.jit`` kernels and one pure wrapper per op, with the op's vocabulary
signature (:mod:`inferhal.core.ops.vocabulary`) plus a keyword ``target``: tensors and a frozen params
dataclass in, tensors out, no global state. Its oracle is the reference op in ``backends/reference``
and its test is in ``tests/kernels/``.

Modules: ``norm`` (norm.rms with fused residual), ``rope`` (rope.apply), ``moe_route`` (moe.route),
``moe_experts`` (moe.experts: grouped GEMM + SwiGLU, bf16 / fp8_block / fp4 via tl.dot_scaled),
``mhc`` (mhc.pre / mhc.post), ``kv_write`` (kv.write, fp8), ``attn_paged`` (attn.paged), ``linear`` (linear,
lm_head, lm_head.argmax: bf16 / fp8_block / fp4_group / int_block weights), ``linear_lowp`` (the FP8 x FP8
and FP4 x FP4 paths with quantised activations), ``embed``, ``act_gated`` (act.gated), ``mhc_head`` (mhc.head),
``spec_verify`` (spec.verify), ``moe_ep`` (moe.dispatch / moe.combine bookkeeping around the all-to-all).
Infrastructure: ``runtime`` (interpreter switch), ``common`` (the INTERP workarounds), ``tuning``
(configs as data), ``registry`` (AOT specs), ``aot`` (compile for sm_100a / sm_103a / sm_90a). The check
on a lent GPU is ``.ci/device_check`` (:mod:`inferhal.core.qualify.device_run` with ``--backend cuda_sm100``).

Interpreter mode: ``TRITON_INTERPRET=1`` must be set before a kernel module is imported; call
``runtime.use_interpreter(True)`` first (the cuda_sm100 plugin does, for ``backend.interpret=true``).
Kernels take one ``INTERP: tl.constexpr`` switch that upcasts bf16 ``tl.dot`` operands and rounds
bf16/e4m3 stores to nearest even under the interpreter only; compiled kernels keep bf16 operands.

Tuning data for other hardware (e.g. the Ascend backend reusing these sources): configs live in
``tuning.TUNING[target][kernel]`` as plain dicts (``BLOCK_*`` constexprs, ``num_warps``,
``num_stages``), e.g. ``{"cuda_sm100": {"moe_gemm": {...}}, "ascend950": {"moe_gemm": {...}}}``.
A backend adds its own with ``tuning.register_target("ascend950", {...})`` and passes
``target="ascend950"`` to the wrappers (``functools.partial``, as ``backends/cuda_sm100/ops.py`` does);
kernels missing from a target's table use ``default``. No kernel hard-codes a tile, and none uses
``@triton.autotune`` (one fixed config per target keeps results batch-invariant and works in the
interpreter).
"""
