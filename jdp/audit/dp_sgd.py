"""Canary audits of DP-SGD (`jdp.clipping.dp_sgd`): empirical lower bounds on ε, to set beside the reported ε.

The routine under audit is DP-SGD as the library runs it: `dp_sgd(...)` builds the step, `DPSGD.init` seeds the
noise, `poisson_sample` draws each step's batch and `DPSGD.step` clips (`clipped_grad`) and adds the noise. The
auditor picks the model and the data, plants canaries (each included in the training data or not) and scores
each canary from what the run releases. Unit: one example; relation: add/remove one example. A canary left out
is a row whose gradient is exactly zero, which releases the same noisy sums as removing it (the sum is divided by
the public expected batch size, never by a count).

Canaries (`canary=`):

* "gradient" — white-box gradient canaries (Nasr et al. 2021, 2023's Dirac canaries). The model is linear in
  its weights W [P, Q] (`nn.Dense` without bias on inputs [B, 2, P], loss Σ out·c), so an example's gradient is
  Σ_t x_t c_tᵀ whatever W is: canary i is x = (s·e_p, 0), c = (s·e_q, 0), gradient s²·E_pq (norm s² ≫ C) on its
  own coordinate (p, q) (P = Q = max(64, ⌈√m⌉)). Score: the total released update's projection on that coordinate.
* "input" — black-box input canaries: a softmax classifier on Gaussian-cluster data; each canary is an
  out-of-distribution input of norm s (the canaries in mutually orthogonal random directions) with a random
  label; the auditor sees only the model's loss on the canary (score: loss before training − loss after).
* "fp-cancel" — the crafted example of the float32 cancellation attack on ghost norms: the same input X
  (entries of std 10³) at both positions and output gradients v, −(1 − e)·v (entries of std 10³, e = 10⁻⁴).
  Its gradient e·X vᵀ has norm ≈ 6·10³; a norm formed as a difference of terms of size ‖X‖²‖v‖² cancels in
  float32 and can come out ≈ 0, so the example would pass unclipped. X and v run over two random orthogonal
  bases, so the canaries' gradients are mutually orthogonal. Score: projection on the canary's true gradient.

Modes: "one-run" (m canaries in one training run, each included w.p. 1/2; `bounds.one_run_audit`) and
"many-run" (one canary, independent runs with and without it, vmapped over run keys; `bounds.many_run_audit`).

Broken variants (`variant=`), so the audit can be seen to fail: "no-clip" (clipping at 10⁶·C while the noise is
still σ·C: the reported ε assumes sensitivity C), "half-noise" (noise multiplier σ/2 while the report states ε at
σ), "old-engine" (`jdp.clipping.norms._FP_BOUND = False` while tracing: the norm computation without its
floating-point bound, the target of the "fp-cancel" canary). The reported ε is always the honest
configuration's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdp.audit.bounds import RoutineAudit, many_run_audit, one_run_audit
from jdp.clipping import DPSGD, calibrate_noise_multiplier, dp_sgd, poisson_sample
from jdp.validation import check_delta, check_epsilon, check_positive

CANARIES = ("gradient", "input", "fp-cancel")
VARIANTS = ("honest", "no-clip", "half-noise", "old-engine")
MODES = ("one-run", "many-run")
_NO_CLIP = 1e6  # "no-clip": the clip bound is multiplied by this (and σ divided by it: same noise std)


@dataclasses.dataclass(frozen=True)
class DPSGDAuditConfig:
    """The DP-SGD setting audited: (ε, δ) calibrates σ for `steps` Poisson-sampled steps at `sampling_rate`."""
    epsilon: float = 2.0
    delta: float = 1e-5
    steps: int = 2
    sampling_rate: float = 1.0
    l2_clip: float = 1.0
    accountant: str = "rdp"
    method: str = "auto"

    def noise_multiplier(self) -> float:
        check_epsilon(self.epsilon)
        check_delta(self.delta)
        check_positive(self.l2_clip, "l2_clip")
        return calibrate_noise_multiplier(self.epsilon, self.delta, self.sampling_rate, self.steps, self.accountant)


# ---------------------------------------------------------------------------------------------------
# Broken variants.
def broken(dpsgd: DPSGD, variant: str) -> DPSGD:
    """`dpsgd` with the DP-SGD-level fault of `variant` ("honest" and "old-engine": unchanged)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if variant == "no-clip":
        return dataclasses.replace(dpsgd, l2_clip=dpsgd.l2_clip * _NO_CLIP,
                                   noise_multiplier=dpsgd.noise_multiplier / _NO_CLIP)
    if variant == "half-noise":
        return dataclasses.replace(dpsgd, noise_multiplier=dpsgd.noise_multiplier / 2)
    return dpsgd


def old_engine_available() -> bool:
    """Whether the clipping engine has the switch that restores its old norm computation."""
    from jdp.clipping import norms
    return hasattr(norms, "_FP_BOUND")


@contextlib.contextmanager
def _engine(variant: str):
    """Traces with `norms._FP_BOUND = False` for "old-engine"; jax's caches are cleared on entry and exit so no
    program traced under one setting is reused under the other."""
    if variant != "old-engine":
        yield
        return
    from jdp.clipping import norms
    if not old_engine_available():
        raise ValueError("variant 'old-engine' needs jdp.clipping.norms._FP_BOUND (the switch that restores the "
                         "norm computation without its floating-point bound); this engine has none")
    saved = norms._FP_BOUND
    jax.clear_caches()
    norms._FP_BOUND = False
    try:
        yield
    finally:
        norms._FP_BOUND = saved
        jax.clear_caches()


# ---------------------------------------------------------------------------------------------------
# Models and canaries.
class _Linear(nn.Module):
    """Dense without bias on [B, 2, P]; the loss Σ out·c is linear in the kernel."""
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.width, use_bias=False)(x)


def _linear_loss(width: int):
    model = _Linear(width)

    def loss_fn(params, batch):
        return jnp.sum(model.apply(params, batch["x"]) * batch["c"], axis=(1, 2))
    return model, loss_fn


class _Softmax(nn.Module):
    classes: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.classes)(x)


def _softmax_loss(classes: int):
    model = _Softmax(classes)

    def loss_fn(params, batch):
        logits = model.apply(params, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return model, loss_fn


def _gradient_canaries(m: int, width: int, scale: float, rng: np.random.Generator):
    """m canaries on distinct coordinates (p, q) of the [width, width] kernel: x = (s e_p, 0), c = (s e_q, 0)."""
    if m > width * width:
        raise ValueError(f"at most width² = {width * width} gradient canaries, got {m}")
    coords = rng.choice(width * width, size=m, replace=False)
    x = np.zeros((m, 2, width), np.float32)
    c = np.zeros((m, 2, width), np.float32)
    x[np.arange(m), 0, coords // width] = scale
    c[np.arange(m), 0, coords % width] = scale
    return {"x": x, "c": c}


def _orthonormal(n: int, dim: int, rng: np.random.Generator) -> np.ndarray:
    """n orthonormal random vectors of length dim (rows), n ≤ dim."""
    q, _ = np.linalg.qr(rng.normal(size=(dim, n)))
    return q.T


def _fp_cancel_canaries(m: int, width: int, rng: np.random.Generator, e: float = 1e-4):
    """The crafted examples: X at both positions, output gradients v and −(1 − e)v, with entries of std 10³.
    X and v run over two random orthogonal bases (scaled by 10³·√width), so the m gradients e·X vᵀ are mutually
    orthogonal (canary (a, b) takes X_a, v_b): no canary's score picks up another's contribution."""
    if m > width * width:
        raise ValueError(f"at most width² = {width * width} fp-cancel canaries, got {m}")
    pairs = rng.choice(width * width, size=m, replace=False)
    X = _orthonormal(width, width, rng)[pairs // width] * 1e3 * math.sqrt(width)
    v = _orthonormal(width, width, rng)[pairs % width] * 1e3 * math.sqrt(width)
    return {"x": np.stack([X, X], 1).astype(np.float32),
            "c": np.stack([v, -(1.0 - e) * v], 1).astype(np.float32)}


def _linear_background(n: int, width: int, rng: np.random.Generator):
    """Ordinary examples of the linear model (gradient norms about 1)."""
    return {"x": rng.normal(size=(n, 2, width)).astype(np.float32),
            "c": (rng.normal(size=(n, 2, width)) / width).astype(np.float32)}


def _cluster_data(n: int, dim: int, classes: int, rng: np.random.Generator, centres: np.ndarray):
    y = rng.integers(0, classes, n)
    x = centres[y] + rng.normal(size=(n, dim)) / math.sqrt(dim)
    return {"x": x.astype(np.float32), "y": y.astype(np.int32)}


def _input_canaries(m: int, dim: int, classes: int, scale: float, rng: np.random.Generator):
    """Out-of-distribution inputs of norm `scale` in mutually orthogonal random directions (m ≤ dim), random
    labels."""
    x = scale * _orthonormal(m, dim, rng)
    return {"x": x.astype(np.float32), "y": rng.integers(0, classes, m).astype(np.int32)}


def _zero_rows(rows: dict, keep: np.ndarray) -> dict:
    """Canary rows with the left-out ones replaced by zero-gradient rows (x = 0)."""
    out = dict(rows)
    out["x"] = np.where(keep.reshape((-1,) + (1,) * (rows["x"].ndim - 1)), rows["x"], 0.0).astype(np.float32)
    return out


def _concat(a: dict, b: dict) -> dict:
    return {k: np.concatenate([a[k], b[k]], 0) for k in a}


# ---------------------------------------------------------------------------------------------------
# Running DP-SGD as the library does.
def _trainer(dpsgd: DPSGD, params0, steps: int):
    """run(key, data) -> final params: `steps` DP-SGD steps (init, Poisson sample, step), jit-able and vmap-able."""
    n, q, mb = dpsgd.num_examples, dpsgd.sampling_rate, dpsgd.max_batch_size

    def run(key, data):
        k_noise, k_sample = jax.random.split(key)
        state = dpsgd.init(params0, k_noise)
        step = dpsgd.step
        for t in range(steps):  # a few steps, unrolled
            idx, mask, _ = poisson_sample(jax.random.fold_in(k_sample, t), n, q, mb)
            batch = jax.tree.map(lambda x: jnp.take(x, idx, axis=0), data)
            state, _ = step(state, batch, mask)
        return state.params
    return run


def _build(cfg: DPSGDAuditConfig, loss_fn, n: int, variant: str) -> tuple[DPSGD, float, float]:
    """(the DPSGD under audit, σ, reported ε). max_batch_size = n: no Poisson sample is ever truncated."""
    sigma = cfg.noise_multiplier()
    honest = dp_sgd(loss_fn, optax.sgd(1.0), num_examples=n, batch_size=cfg.sampling_rate * n,
                    l2_clip=cfg.l2_clip, delta=cfg.delta, steps=cfg.steps, noise_multiplier=sigma,
                    method=cfg.method, max_batch_size=n, accountant=cfg.accountant)
    return broken(honest, variant), sigma, honest.epsilon()


def _as_run(dpsgd: DPSGD) -> dict:
    """What the audited run used (differs from the reported setting in the broken variants)."""
    return {"run_noise_multiplier": dpsgd.noise_multiplier, "run_l2_clip": dpsgd.l2_clip,
            "run_noise_std": dpsgd.noise_multiplier * dpsgd.l2_clip}


def _kernel(params):
    return params["params"]["Dense_0"]["kernel"]


def audit_dp_sgd(key: jax.Array, cfg: DPSGDAuditConfig = DPSGDAuditConfig(), *, canary: str = "gradient",
                 mode: str = "one-run", canaries: int = 1000, runs: int = 20000, background: int = 8,
                 variant: str = "honest", confidence: float = 0.95, canary_scale: float | None = None,
                 seed: int, run_chunk: int = 20000) -> RoutineAudit:
    """Audits DP-SGD at `cfg` with canaries of kind `canary` in `mode`; returns the reported ε beside the bound.

    one-run: `canaries` canaries (each in w.p. 1/2) and `background` ordinary examples in one training run.
    many-run ("gradient" only): one canary and `background` examples; `runs` independent runs with the canary
    and `runs` without (vmapped in chunks of `run_chunk`). `key` seeds the runs' noise; `seed` (public) the data,
    the canaries and their inclusion. `variant` selects a deliberately broken DP-SGD (module docstring)."""
    if canary not in CANARIES:
        raise ValueError(f"canary must be one of {CANARIES}, got {canary!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if mode == "many-run" and canary != "gradient":
        raise ValueError("mode 'many-run' is implemented for canary='gradient'")
    if int(canaries) < 2 or int(runs) < 2 or int(background) < 0:
        raise ValueError("need canaries >= 2, runs >= 2 and background >= 0")
    rng = np.random.default_rng(seed)
    setting = {"canary": canary, "mode": mode, "epsilon_target": cfg.epsilon, "steps": cfg.steps,
               "sampling_rate": cfg.sampling_rate, "l2_clip": cfg.l2_clip, "background": int(background)}
    if mode == "many-run":
        result, extra = _many_run_gradient(key, cfg, int(runs), int(background), variant, confidence,
                                           canary_scale or 10.0, rng, int(run_chunk), seed)
    else:
        result, extra = _one_run(key, cfg, canary, int(canaries), int(background), variant, confidence,
                                 canary_scale, rng)
    setting.update(extra)
    threat = {"gradient": "white-box gradient canaries", "input": "black-box input canaries",
              "fp-cancel": "crafted float32-cancellation canaries"}[canary]
    return RoutineAudit(f"dp-sgd ({threat}, {mode})", variant, extra["reported_epsilon"], result, setting)


def _one_run(key, cfg, canary, m, n_bg, variant, confidence, scale, rng):
    keep = rng.random(m) < 0.5
    if canary == "input":
        dim, classes = max(64, m), 10
        scale = 20.0 if scale is None else scale
        centres = rng.normal(size=(classes, dim))
        model, loss_fn = _softmax_loss(classes)
        rows = _input_canaries(m, dim, classes, scale, rng)
        data = _concat(_zero_rows(rows, keep), _cluster_data(max(n_bg, 1), dim, classes, rng, centres))
        params0 = model.init(jax.random.key(0), jnp.zeros((1, dim)))
    else:
        # the crafted example is the #69 item-1 case (Dense(64)); gradient canaries need width² ≥ m coordinates
        width = 64 if canary == "fp-cancel" else max(64, math.isqrt(m - 1) + 1)
        model, loss_fn = _linear_loss(width)
        if canary == "gradient":
            scale = 10.0 if scale is None else scale
            rows = _gradient_canaries(m, width, scale, rng)
        else:
            rows = _fp_cancel_canaries(m, width, rng)
        data = _concat(_zero_rows(rows, keep), _linear_background(max(n_bg, 1), width, rng))
        params0 = model.init(jax.random.key(0), jnp.zeros((1, 2, width)))
        params0 = jax.tree.map(jnp.zeros_like, params0)
    n = m + max(n_bg, 1)
    dpsgd, sigma, reported = _build(cfg, loss_fn, n, variant)
    with _engine(variant):
        params = jax.jit(_trainer(dpsgd, params0, cfg.steps))(key, {k: jnp.asarray(v) for k, v in data.items()})
        params = jax.block_until_ready(params)
    if canary == "input":
        canary_rows = {k: jnp.asarray(v) for k, v in rows.items()}
        scores = np.asarray(loss_fn(params0, canary_rows) - loss_fn(params, canary_rows), np.float64)
    else:
        # the canary's own gradient (the same at every W: the model is linear), as a unit direction
        grads = jax.vmap(jax.grad(lambda p, x, c: loss_fn(p, {"x": x[None], "c": c[None]})[0]),
                         in_axes=(None, 0, 0))(params0, jnp.asarray(rows["x"]), jnp.asarray(rows["c"]))
        g = np.asarray(_kernel(grads), np.float64).reshape(m, -1)
        g /= np.linalg.norm(g, axis=1, keepdims=True)
        delta_w = np.asarray(_kernel(params0) - _kernel(params), np.float64).reshape(-1)
        scores = g @ delta_w
    if not np.all(np.isfinite(scores)):
        raise ValueError("non-finite canary scores: the run diverged")
    result = one_run_audit(scores, keep, cfg.delta, confidence)
    return result, {"reported_epsilon": reported, "noise_multiplier": sigma, "canaries": m,
                    "canary_scale": scale, "runs": 1, **_as_run(dpsgd)}


def _many_run_gradient(key, cfg, runs, n_bg, variant, confidence, scale, rng, chunk, seed):
    width = 8
    model, loss_fn = _linear_loss(width)
    canary = _gradient_canaries(1, width, scale, rng)
    bg = _linear_background(max(n_bg, 1), width, rng)
    params0 = jax.tree.map(jnp.zeros_like, model.init(jax.random.key(0), jnp.zeros((1, 2, width))))
    n = 1 + max(n_bg, 1)
    dpsgd, sigma, reported = _build(cfg, loss_fn, n, variant)
    p, q = int(np.argmax(canary["x"][0, 0])), int(np.argmax(canary["c"][0, 0]))
    data_in = {k: jnp.asarray(v) for k, v in _concat(canary, bg).items()}
    data_out = {k: jnp.asarray(v) for k, v in _concat(_zero_rows(canary, np.zeros(1, bool)), bg).items()}
    run = _trainer(dpsgd, params0, cfg.steps)

    @jax.jit
    def scores_of(keys, flags):
        def one(k, f):
            data = jax.tree.map(lambda a, b: jnp.where(f, a, b), data_in, data_out)
            return -_kernel(run(k, data))[p, q]
        return jax.vmap(one)(keys, flags)

    keys = jax.random.split(key, 2 * runs)
    flags = np.concatenate([np.ones(runs, bool), np.zeros(runs, bool)])
    out = []
    with _engine(variant):
        for i in range(0, 2 * runs, chunk):
            k, f = keys[i:i + chunk], flags[i:i + chunk]
            if k.shape[0] < chunk:  # pad the last chunk to the compiled size
                pad = chunk - k.shape[0]
                k = jnp.concatenate([k, keys[:pad]])
                f = np.concatenate([f, flags[:pad]])
                out.append(np.asarray(scores_of(k, f))[: chunk - pad])
            else:
                out.append(np.asarray(scores_of(k, f)))
    s = np.concatenate(out).astype(np.float64)
    if not np.all(np.isfinite(s)):
        raise ValueError("non-finite canary scores: a run diverged")
    result = many_run_audit(s[:runs], s[runs:], cfg.delta, confidence, seed=seed)
    return result, {"reported_epsilon": reported, "noise_multiplier": sigma, "canaries": 1, "runs": 2 * runs,
                    "canary_scale": scale, **_as_run(dpsgd)}


__all__ = ["CANARIES", "DPSGDAuditConfig", "MODES", "VARIANTS", "audit_dp_sgd", "broken",
           "old_engine_available"]
