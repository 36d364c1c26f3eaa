"""``inferhal serve``'s disaggregation roles and the ``disagg`` group: every setting a role cannot honour is
refused before anything loads, spawns or connects, naming the field (core/server/serve.py: check_roles)."""

from __future__ import annotations

import pytest

from inferhal.core.errors import UserError


def cfg_of(*over, command="serve"):
    from inferhal.core.cli.main import compose

    return compose(["model=deepseek_v4_tiny", *over], command=command)


def test_parallel_role_is_refused_outside_serve():
    from inferhal.core.config.errors import ConfigError

    with pytest.raises(ConfigError, match="parallel.role='pd' is refused"):
        cfg_of("parallel.role=pd", command="generate")


@pytest.mark.parametrize("over, words", [
    (["parallel.role=both"], r"parallel.role='both': `inferhal serve` runs any, pd, prefill, decode, router"),
    (["parallel.role=pd", "scheduler.async_scheduling=true"], "async_scheduling=false"),
    (["parallel.role=decode", "parallel=ep2", "disagg.authkey=k"], "each prefill or decode instance is one engine process"),
    (["parallel.role=pd", "parallel.timeout_s=0"], "parallel.timeout_s=0 must be > 0"),
    (["parallel.role=pd", "disagg.restarts=-1"], "disagg.restarts must be >= 0"),
    (["parallel.role=router", "disagg.authkey=k"], "needs its instances"),
    (["parallel.role=router", "disagg.authkey=k", "disagg.prefill=[nohost]"], r"disagg.prefill\[0\]: 'nohost' is not an address"),
    (["parallel.role=router", "disagg.authkey=k", "disagg.decode=[h:1]", "disagg.reconnect_s=-1"], "reconnect_s must be >= 0"),
    (["parallel.role=prefill", "disagg.authkey=k", "disagg.listen=0.0.0.0:99999"], "disagg.listen"),
    (["parallel.role=decode", "disagg.authkey=k", "disagg.kv_port=70000"], "disagg.kv_port must be in"),
    (["disagg.prefill=[h:1]"], r"disagg.prefill=\['h:1'\] is read by parallel.role=router only, not by parallel.role=any"),
    (["parallel.role=pd", "disagg.listen=1.2.3.4:5"], "disagg.listen='1.2.3.4:5' is read by parallel.role=prefill|decode only"),
    (["parallel.role=prefill", "disagg.authkey=k", "disagg.kv_port=5"], "read by parallel.role=decode only"),
    (["parallel.role=router", "disagg.decode=[h:1]", "disagg.restarts=1", "disagg.authkey=k"], "read by parallel.role=pd only"),
])
def test_serve_refuses_what_a_role_cannot_honour(over, words):
    from inferhal.core.server.serve import check_roles

    with pytest.raises(UserError, match=words):
        check_roles(cfg_of(*over))


def test_separate_launches_need_the_shared_key(monkeypatch):
    from inferhal.core.disagg.link import KEY_ENV
    from inferhal.core.server.serve import check_roles

    monkeypatch.delenv(KEY_ENV, raising=False)
    for role in ("prefill", "decode"):
        with pytest.raises(UserError, match=f"disagg.authkey=... or the environment variable {KEY_ENV}"):
            check_roles(cfg_of(f"parallel.role={role}"))
    monkeypatch.setenv(KEY_ENV, "s3cret")
    check_roles(cfg_of("parallel.role=router", "disagg.prefill=[10.0.0.5:7100]", "disagg.decode=['[::1]:7101']"))
    check_roles(cfg_of("parallel.role=pd"))  # draws its own key


def test_the_cli_refuses_a_role_cleanly(capsys):
    from inferhal.core.cli.main import main

    assert main(["serve", "model=deepseek_v4_tiny", "parallel.role=router", "disagg.authkey=k"]) == 2
    err = capsys.readouterr().err
    assert "needs its instances" in err and "Traceback" not in err
