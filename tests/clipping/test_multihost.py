"""DP-SGD over two processes (jax.distributed, CPU collectives over localhost, 2 devices each) gives the same
parameters as one process with one device: the mesh spans both processes' devices, each device clips its rows,
one all-reduce adds them and every process draws the same noise from the same key."""
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

WORKER = r"""
import sys
import jax
pid, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if pid >= 0:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=120)
    assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2
import numpy as np, optax, flax.linen as nn
from jdp.clipping import dp_sgd
from jdp.clipping.sharding import data_mesh

model = nn.Dense(1)
x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
x[3] *= 1e3  # a row far past the clip bound
data = {"x": x, "y": x.sum(1)}
params = model.init(jax.random.key(0), x[:1])
loss_fn = lambda p, b: (model.apply(p, b["x"])[:, 0] - b["y"]) ** 2
dp = dp_sgd(loss_fn, optax.sgd(0.1), num_examples=256, batch_size=32, l2_clip=1.0, delta=1e-4, steps=4,
            noise_multiplier=1.0, mesh=data_mesh() if pid >= 0 else None, max_batch_size=72)
p, rep, _ = dp.fit(params, data, jax.random.key(1), progress=False)
np.save(out, np.concatenate([np.ravel(np.asarray(jax.device_get(l))) for l in jax.tree.leaves(p)]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_one_process(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), port, str(tmp_path / f"p{i}.npy")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    try:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-2000:] for log in logs)
    single = subprocess.run([sys.executable, "-c", WORKER, "-1", port, str(tmp_path / "one.npy")], env=env,
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-2000:]
    p0, p1, one = (np.load(tmp_path / f) for f in ("p0.npy", "p1.npy", "one.npy"))
    np.testing.assert_array_equal(p0, p1)   # every process holds the same replicated parameters
    np.testing.assert_allclose(p0, one, rtol=2e-5, atol=2e-6)
    assert not np.allclose(one, 0.0)
