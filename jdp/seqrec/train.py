"""DP-SGD training of sequential recommenders (DPFormer and baselines).

Privacy unit: one user = one training sequence; neighbouring relation: add/remove one user's
sequence. Each step samples every user independently with probability q = B/N (Poisson sampling,
processed in fixed-size padded physical chunks, no truncation), sums per-user clipped gradients
(norm over all parameters jointly, clip C), adds N(0, σ²C²I), divides by the expected batch size B
and applies Adam(W) with linear warm-up + linear decay. Released: T subsampled Gaussian steps and,
for DPFormer without public counts, one Gaussian item histogram (for Re-Attention's p_i); σ is
calibrated so the composition of both meets (ε, δ) under dp_accounting's RDP accountant.

`epsilon=None` is the explicitly NON-PRIVATE reference (no clipping, no noise, no report).
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from typing import Any

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
from dp_accounting import dp_event as dpe
from tqdm.auto import tqdm

from jdp import accounting
from jdp.seqrec import reattention as ra
from jdp.seqrec._clip_fallback import clipped_grad as fallback_clipped_grad
from jdp.seqrec._clip_fallback import get_clipped_grad
from jdp.seqrec.data import SeqData, item_presence
from jdp.seqrec.evaluate import evaluate, make_rank_fn_reatt
from jdp.seqrec.models import make_loss_fn, make_model


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters (paper defaults where it states them: warm-up 20%, Adam, wd 1e-5, C = 1)."""
    model: str = "dpformer"
    epsilon: float | None = 8.0       # None = non-private reference run
    delta: float = 1e-5
    epochs: float = 100.0
    batch_size: int = 1024            # expected Poisson batch size B = qN
    lr: float = 1e-3
    warmup_frac: float = 0.2
    weight_decay: float = 1e-5
    l2_clip: float = 1.0
    normalize: bool = False           # normalised clipping g·C/‖g‖ (the paper's choice) instead of min(1, C/‖g‖)
    clipping: str = "engine"          # "engine" (jdp.clipping when installed) or "vmap" (exact fallback)
    d: int = 64
    heads: int = 1
    blocks: int = 2
    dropout: float = 0.5
    activation: str = "relu"
    physical_batch: int = 256         # examples per jit call (padded, masked)
    micro_batch: int = 32             # examples whose per-example grads are materialised at once (fallback)
    hist_noise_multiplier: float = 10.0  # Gaussian histogram noise / sqrt(maxlen+1)
    error_scale: float = 1.0          # multiplies Re-Attention's effective errors (paper: 1)
    eval_every_epochs: float = 0.0    # 0 = only at the end (validation history otherwise)
    mask_history: bool = False
    eval_chunk: int = 1024
    length_buckets: tuple = (8, 16, 32, 64, 128)  # window lengths used for short sequences (compute only)
    n_users_public: int | None = None  # declared public bound on the users: sets q = B/N and the steps

    def validate(self) -> None:
        if self.epsilon is not None:
            accounting.check_epsilon(self.epsilon)
        accounting.check_delta(self.delta)
        for name in ("epochs", "lr", "l2_clip", "hist_noise_multiplier"):
            accounting.check_positive(getattr(self, name), name)
        accounting.check_positive(self.weight_decay, "weight_decay", allow_zero=True)
        accounting.check_positive(self.error_scale, "error_scale", allow_zero=True)
        if not 0.0 <= self.warmup_frac < 1.0:
            raise ValueError(f"warmup_frac must be in [0, 1), got {self.warmup_frac}")
        for name in ("batch_size", "physical_batch", "micro_batch", "d", "heads", "blocks", "eval_chunk"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.clipping not in ("engine", "vmap"):
            raise ValueError(f"clipping must be 'engine' or 'vmap', got {self.clipping!r}")
        if self.physical_batch % self.micro_batch:
            raise ValueError("physical_batch must be a multiple of micro_batch")


@dataclasses.dataclass
class TrainResult:
    params: Any
    metrics: dict
    privacy: accounting.PrivacyReport | None
    noise_multiplier: float
    steps: int
    history: list
    timings: dict
    reatt: dict | None
    item_counts_released: np.ndarray | None


def lr_schedule(lr: float, steps: int, warmup_frac: float) -> optax.Schedule:
    """Linear warm-up over the first warmup_frac of the steps, then linear decay to 0."""
    warm = max(1, int(round(warmup_frac * steps)))
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warm),
                                 optax.linear_schedule(lr, 0.0, max(1, steps - warm))], [warm])


def sampling_plan(data: SeqData, cfg: TrainConfig) -> tuple[int, float, int]:
    """(N, q = B/N, steps) from the declared public number of users, else from the data's count (which the
    report then states as an assumption: under add/remove-one-user it is private)."""
    n_data = data.n_users
    N = n_data if cfg.n_users_public is None else int(cfg.n_users_public)
    if N < n_data:
        raise ValueError(f"n_users_public ({N}) must be >= the users in the data ({n_data})")
    if cfg.batch_size > N:
        raise ValueError(f"batch_size must be <= number of users ({N}), got {cfg.batch_size}")
    return N, cfg.batch_size / N, max(1, int(math.ceil(cfg.epochs * N / cfg.batch_size)))


def dp_sgd_event(noise_multiplier: float, sampling_rate: float, steps: int) -> dpe.DpEvent:
    return dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(sampling_rate, dpe.GaussianDpEvent(noise_multiplier)), steps)


def privacy_setup(data: SeqData, cfg: TrainConfig, key: jax.Array, public_item_counts: np.ndarray | None = None
                  ) -> tuple[accounting.PrivacyReport | None, float, np.ndarray | None]:
    """(report, noise multiplier σ, item counts for Re-Attention) for a run of cfg; (None, 0, None)
    when non-private. DPFormer: caller-declared public counts, else a Gaussian histogram release. The
    data's vocabulary release (vocabulary='private') is composed into the same report and σ is
    calibrated for the total; its assumptions (public / exact vocabulary) are stated in the report."""
    cfg.validate()
    if cfg.epsilon is None:
        return None, 0.0, None
    L, M = data.maxlen, data.n_items
    N, q, steps = sampling_plan(data, cfg)
    report = accounting.PrivacyReport(cfg.delta, unit="user", relation="add/remove one user's sequence")
    if cfg.n_users_public is None:
        report.assume(f"number of users N = {N} treated as public (sets the sampling rate q = B/N and the "
                      "number of steps); declare a public bound with TrainConfig(n_users_public=...)")
    # the vocabulary's own release (private mode) or the assumption it rests on (public / exact)
    report.releases.extend(data.vocab_releases)
    for text in data.vocab_assumptions:
        report.assume(text)
    counts_rel = None
    if cfg.model == "dpformer":
        if public_item_counts is not None:
            counts_rel = np.asarray(public_item_counts, np.float64)
            if counts_rel.shape != (M + 1,) or not np.isfinite(counts_rel).all():
                raise ValueError(f"public_item_counts must be a finite array of shape ({M + 1},)")
            report.assume("Re-Attention item counts (public_item_counts) declared public by the caller")
        else:
            counts_rel = ra.private_item_counts(key, item_presence(data.train_input, data.train_target, M),
                                                L + 1, cfg.hist_noise_multiplier, report)
    fixed = [r.composed_event() for r in report.releases]
    sigma = accounting.calibrate(lambda s: dpe.ComposedDpEvent(fixed + [dp_sgd_event(s, q, steps)]),
                                 cfg.epsilon, cfg.delta, bracket=(0.05, 500.0))
    report.add("DP-SGD step (Poisson-sampled Gaussian)", dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(sigma)),
               sensitivity=cfg.l2_clip, noise_scale=sigma * cfg.l2_clip, count=steps)
    return report, float(sigma), counts_rel


def train(data: SeqData, cfg: TrainConfig, key: jax.Array, public_item_counts: np.ndarray | None = None,
          checkpoint: str | pathlib.Path | None = None, checkpoint_every: int = 50,
          progress: bool = True, evaluate_test: bool = True) -> TrainResult:
    """Trains cfg.model with DP-SGD at (cfg.epsilon, cfg.delta) and evaluates on valid/test.

    Unit: user (one sequence); relation: add/remove one user. public_item_counts: caller-DECLARED
    public per-item sequence counts [M+1] for Re-Attention (then no histogram is released); otherwise
    DPFormer releases a Gaussian histogram accounted in the report. Exact counts are never used.
    """
    cfg.validate()
    t_start = time.perf_counter()
    L, M = data.maxlen, data.n_items
    N, q, steps = sampling_plan(data, cfg)
    private = cfg.epsilon is not None
    if public_item_counts is not None and cfg.model == "dpformer":  # validate before any work
        if np.shape(public_item_counts) != (M + 1,):
            raise ValueError(f"public_item_counts must be a finite array of shape ({M + 1},)")
    model = make_model(cfg.model, M, L, cfg.d, cfg.heads, cfg.blocks, cfg.dropout, cfg.activation)
    k_init, k_hist, k_train = jax.random.split(key, 3)

    report, sigma, counts_rel = privacy_setup(data, cfg, k_hist, public_item_counts)
    reatt = None
    if cfg.model == "dpformer":
        if counts_rel is None:  # non-private reference: zero noise -> Re-Attention is the identity
            counts_rel = np.ones(M + 1)
        w_var, emb_var = ra.effective_variances(sigma, cfg.l2_clip, cfg.batch_size, q, counts_rel, cfg.error_scale)
        reatt = {"w_var": jnp.float32(w_var), "emb_var": jnp.asarray(emb_var)}

    # ---- model, optimiser ----
    params = jax.jit(model.init)(k_init, jnp.zeros((1, L), jnp.int32))
    opt = optax.adamw(lr_schedule(cfg.lr, steps, cfg.warmup_frac), weight_decay=cfg.weight_decay)
    opt_state = opt.init(params)
    loss_fn = make_loss_fn(model, reatt)
    engine = get_clipped_grad() if cfg.clipping == "engine" else fallback_clipped_grad
    P = cfg.physical_batch

    @jax.jit
    def accumulate(params, acc, inp, tgt, keys, mask):
        batch = {"input": inp, "target": tgt, "key": keys}
        if not private:
            loss, g = jax.value_and_grad(lambda p: jnp.sum(loss_fn(p, batch) * mask))(params)
            return jax.tree_util.tree_map(jnp.add, acc, g), loss, jnp.int32(0)
        if engine is fallback_clipped_grad:
            res = engine(loss_fn, params, batch, l2_clip=cfg.l2_clip, mask=mask, micro_batch=cfg.micro_batch,
                         normalize=cfg.normalize)
        else:
            res = engine(loss_fn, params, batch, l2_clip=cfg.l2_clip, mask=mask, normalize=cfg.normalize)
        # `where`, not `* mask`: a padding row's NaN loss must not reach the diagnostic sum
        loss = jnp.sum(jnp.where(mask > 0, res.loss, 0.0))
        return jax.tree_util.tree_map(jnp.add, acc, res.grad_sum), loss, jnp.asarray(res.num_nonfinite, jnp.int32)

    @jax.jit
    def update(params, opt_state, acc, k):
        leaves, tdef = jax.tree_util.tree_flatten(acc)
        ks = jax.random.split(k, len(leaves))
        noisy = [(g + sigma * cfg.l2_clip * jax.random.normal(kk, g.shape, g.dtype)) / cfg.batch_size
                 for g, kk in zip(leaves, ks)]
        grad = jax.tree_util.tree_unflatten(tdef, noisy)
        upd, opt_state = opt.update(grad, opt_state, params)
        return optax.apply_updates(params, upd), opt_state

    start = 0
    ckpt = pathlib.Path(checkpoint) if checkpoint else None
    if ckpt is not None and ckpt.exists():
        state = flax.serialization.from_bytes({"params": params, "opt_state": opt_state, "step": 0}, ckpt.read_bytes())
        params, opt_state, start = state["params"], state["opt_state"], int(state["step"])

    zero = jax.tree_util.tree_map(jnp.zeros_like, params)
    # Length buckets: users are processed in windows of the smallest bucket >= their length. Padding
    # never influences outputs of real positions (masked attention, right-anchored positions), so this
    # only saves compute (RNNs see fewer leading zero inputs).
    lens = (data.train_input > 0).sum(1)
    buckets = np.array(sorted({int(b) for b in cfg.length_buckets if 0 < b < L} | {L}))
    bucket_id = np.searchsorted(buckets, lens)
    history, t_train = [], 0.0
    eval_every = int(round(cfg.eval_every_epochs * N / cfg.batch_size)) if cfg.eval_every_epochs > 0 else 0
    it = tqdm(range(start, steps), desc=f"{cfg.model} eps={cfg.epsilon}", disable=not progress, initial=start, total=steps)
    for step in it:
        t0 = time.perf_counter()
        ks, kn, kd = jax.random.split(jax.random.fold_in(k_train, step), 3)
        idx = np.flatnonzero(np.asarray(jax.random.bernoulli(ks, q, (data.n_users,))))
        acc, loss_sum, c, nonfinite = zero, 0.0, 0, 0
        for bi, Lb in enumerate(buckets):  # every sampled user is processed exactly once
            sel = idx[bucket_id[idx] == bi]
            for s0 in range(0, sel.size, P):
                part = sel[s0:s0 + P]
                part_p = np.concatenate([part, np.zeros(P - part.size, np.int64)])
                m = (np.arange(P) < part.size).astype(np.float32)
                keys = jax.random.split(jax.random.fold_in(kd, c), P)
                acc, ls, bad = accumulate(params, acc, jnp.asarray(data.train_input[part_p, L - Lb:]),
                                          jnp.asarray(data.train_target[part_p, L - Lb:]), keys, jnp.asarray(m))
                loss_sum += ls
                nonfinite += bad
                c += 1
        if int(nonfinite):  # such users were dropped (the bound holds), but training has diverged
            raise FloatingPointError(f"step {step}: {int(nonfinite)} sampled users had a non-finite loss or "
                                     "gradient (lower the learning rate or check the data)")
        params, opt_state = update(params, opt_state, acc, kn)
        loss = float(loss_sum) / max(idx.size, 1)
        t_train += time.perf_counter() - t0
        it.set_postfix(loss=f"{loss:.3f}", batch=idx.size)
        if ckpt is not None and ((step + 1) % checkpoint_every == 0 or step + 1 == steps):
            ckpt.write_bytes(flax.serialization.to_bytes({"params": params, "opt_state": opt_state, "step": step + 1}))
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            m = evaluate(model, params, data.valid_input, data.valid_target, mask_history=cfg.mask_history,
                         chunk=cfg.eval_chunk, reatt=reatt, length_buckets=cfg.length_buckets)
            history.append({"step": step + 1, "epoch": (step + 1) * cfg.batch_size / N, "train_loss": loss,
                            "ndcg_at_10_valid": m["ndcg"], "hit_at_10_valid": m["hit"]})

    t0 = time.perf_counter()
    rank_fn = make_rank_fn_reatt(model, cfg.mask_history, reatt)
    mv = evaluate(model, params, data.valid_input, data.valid_target, chunk=cfg.eval_chunk, rank_fn=rank_fn,
                  length_buckets=cfg.length_buckets)
    metrics = {"ndcg_at_10_valid": mv["ndcg"], "hit_at_10_valid": mv["hit"], "n_valid_users": mv["n_users"]}
    if evaluate_test:
        mt = evaluate(model, params, data.test_input, data.test_target, chunk=cfg.eval_chunk, rank_fn=rank_fn,
                  length_buckets=cfg.length_buckets)
        metrics.update({"ndcg_at_10_test": mt["ndcg"], "hit_at_10_test": mt["hit"], "n_test_users": mt["n_users"]})
    t_eval = time.perf_counter() - t0
    timings = {"train_s": t_train, "eval_s": t_eval, "total_s": time.perf_counter() - t_start,
               "steps_run": steps - start, "s_per_step": t_train / max(1, steps - start)}
    return TrainResult(params, metrics, report, float(sigma), steps, history, timings, reatt, counts_rel)


__all__ = ["TrainConfig", "TrainResult", "dp_sgd_event", "lr_schedule", "privacy_setup", "train"]
