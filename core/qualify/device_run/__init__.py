"""One prepared run of a backend on a lent accelerator: ``python -m inferhal.core.qualify.device_run.cli --backend NAME``.

The backend is a parameter; nothing here names a device. What a run records (each row as it is measured,
with its execution level; :mod:`.record`):

- ``env``: torch, the backend's toolchain, the device and its profile, the optional packages' versions;
- ``kernels``, ``v4_shapes``, ``e2e``, ``gemma`` (:mod:`.numerics`, :mod:`.shapes`): every conformance case,
  the ops at DeepSeek-V4 shapes (every variant the op offers), and whole models, each against the reference
  backend on the same device;
- ``resources``: registers, spills and shared memory of every kernel, compiled for the device's target by the
  backend's ``aot_compiler`` extra;
- ``perf`` (:mod:`.timing`): the kernels at V4-Flash sizes, old and new variants on the same inputs, beside
  ceilings measured in the same run at the same shapes (copy, row gather, torch's products, SDPA);
- ``graphs``, ``speed``, ``peer``, ``serve`` (:mod:`.speed`): a decode step eager and replayed, the engine's
  decode tok/s eager against graphs, transformers on the same device, ``inferhal serve`` under load;
- ``layer`` (:mod:`.layer`): V4-Flash-sized decode layers under the profiler, each op's share of the step.

``--interpret`` is the dry run on a host: the same code in the backend's interpreter at reduced sizes, every
row saying ``interpreter`` (timings ``dry-run``: never a hardware result). :mod:`.cli` orders the sections
and keeps the run within its budget.
"""
