"""jdp.hostmem: large XLA outputs reuse freed memory instead of faulting in fresh pages on every call."""
import os
import subprocess
import sys

import pytest

PROBE = r"""
import resource, sys
from jdp.hostmem import reuse_freed_memory
enabled = reuse_freed_memory()
import jax, jax.numpy as jnp
# a 64 MiB intermediate per call (the [rows x items] logits of a full softmax), a small output
f = jax.jit(lambda h, e: jnp.sum(jax.nn.softmax(h @ e.T, axis=-1) * 2.0, axis=0))
h, e = jnp.ones((1024, 16)), jnp.ones((16384, 16))
for _ in range(5):  # warm-up: the reused heap settles at its size
    f(h, e).block_until_ready()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    f(h, e).block_until_ready()
print(enabled, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
"""


def _probe(env_value):
    env = dict(os.environ, JDP_HOST_MALLOC=env_value)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    enabled, faults = out.stdout.split()
    return enabled == "True", int(faults)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings (Linux)")
def test_reuse_freed_memory_removes_the_page_faults_of_large_outputs():
    on, faults_on = _probe("")
    if not on:
        pytest.skip("not glibc (or a preloaded allocator): nothing to set")
    off, faults_off = _probe("system")
    assert not off
    pages = 10 * 64 * 2**20 // 4096     # 10 calls with a 64 MiB intermediate: its pages fault on every call
    assert faults_off > pages // 2      # (measured: ~25,000 faults per call)
    assert faults_on * 3 < faults_off   # (measured: 0 idle, up to ~25,000 under load)


def test_system_setting_turns_it_off(monkeypatch):
    from jdp import hostmem
    monkeypatch.setattr(hostmem, "_state", {})
    monkeypatch.setenv("JDP_HOST_MALLOC", "system")
    assert hostmem.reuse_freed_memory() is False
    assert hostmem.reuse_freed_memory() is False   # remembered


def test_commands_reuse_only_when_asked(monkeypatch):
    from jdp import hostmem
    calls = []
    monkeypatch.setattr(hostmem, "reuse_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.delenv("JDP_HOST_MALLOC", raising=False)
    assert hostmem.reuse_freed_memory_if_requested() is False and not calls
    monkeypatch.setenv("JDP_HOST_MALLOC", "reuse")
    assert hostmem.reuse_freed_memory_if_requested() is True and calls == [1]
