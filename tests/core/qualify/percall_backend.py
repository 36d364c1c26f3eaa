"""A test backend whose native norm.rms hands the calls outside its (pretend) operator's limits, D >= 512, to
the reference and says so in its ``fallback_log`` (what ``runner.fallback_log`` reads), like a torch_npu
wrapper outside an operator's documented limits."""

from __future__ import annotations

from cpu_hooks import inferhal_api_version, inferhal_communicator, inferhal_device, inferhal_kv_storage  # noqa: F401 (hooks of this backend too)
from inferhal.core.hookspecs import hookimpl
from inferhal.core.profile import DeviceProfile, ExecLevel, Probe


@hookimpl
def inferhal_probe():
    return Probe(True, "per-call fallback test backend: always available")


@hookimpl
def inferhal_device_profile(config):
    return DeviceProfile(backend="percall", device_name="per-call fallback test device", torch_device="cpu",
                         exec_level=ExecLevel.DEVICE, dtypes={"float32", "bfloat16"})


class LoggedOp:
    """An op at its level with the log of the calls it handed to the reference."""

    def __init__(self, fn, fallback_log: list) -> None:
        self.fn, self.level, self.note, self.fallback_log = fn, ExecLevel.DEVICE, "pretend operator", fallback_log

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def _rms(log):
    from inferhal.backends.reference.ops import norm_rms

    def rms(x, weight, p, residual=None):
        if x.shape[-1] >= 512:
            log.append(("norm.rms", f"D={x.shape[-1]}: the operator takes D < 512"))
        return norm_rms(x, weight, p, residual)  # both branches compute the reference's result here

    return rms


@hookimpl
def inferhal_provide_ops():
    log: list = []
    return {"norm.rms": LoggedOp(_rms(log), fallback_log=log)}
