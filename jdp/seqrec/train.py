"""DP-SGD training of sequential recommenders (DPFormer and baselines), on the library's one DP-SGD path.

Privacy unit: one user = one training sequence; neighbouring relation: add/remove one user's
sequence. Each step is `jdp.clipping.dp_sgd`'s: a Poisson sample (every user independently with
probability q = B/N, no truncation), the sum of per-user clipped gradients from `jdp.clipping.clipped_grad`
(norm over all parameters jointly, clip C; Phantom clipping for the tied input/output embedding),
N(0, σ²C²I) added and the sum divided by the expected batch size B (`dp_aggregate`), then Adam(W) with
linear warm-up + linear decay. Released: T subsampled Gaussian steps and, for DPFormer without public
counts, one Gaussian item histogram (for Re-Attention's p_i); σ is calibrated so the composition of
both meets (ε, δ) under dp_accounting's RDP accountant.

Speed: a step's sample is laid out in physical chunks by sequence length (`length_chunks`): each chunk
holds users of similar length in the shortest window that fits them, about `chunk_rows` positions per
chunk, so the full-softmax output layer (most of the FLOPs) is computed at few padding positions.
Padding never changes an output (masked attention, right-anchored positions, masked rows).

`epsilon=None` is the explicitly NON-PRIVATE reference (no clipping, no noise, no report).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import math
import pathlib
import time
from typing import Any, NamedTuple

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
from dp_accounting import dp_event as dpe
from tqdm.auto import tqdm

from jdp import accounting
from jdp.clipping import METHODS as CLIPPING_METHODS
from jdp.clipping.dp_sgd import (calibrate_noise_multiplier, clipped_accumulate, dp_sgd, dp_sgd_event,
                                  dp_sgd_release, poisson_indices, with_noise_key, without_noise_key)
from jdp.clipping.engine import check_batch_chunk, split_into_chunks
from jdp.seqrec import reattention as ra
from jdp.seqrec import transitions as tr
from jdp.seqrec.data import SeqData, item_presence
from jdp.seqrec.evaluate import baseline_metrics, evaluate, evaluation_shapes, make_rank_fn_reatt
from jdp.seqrec.models import NORMS, check_item_dim, make_loss_fn, make_model
from jdp.validation import check_positive, check_privacy


# Shorter windows (compute only): every length up to 8, then steps of ~25%, so a user's window wastes
# at most ~20% of its positions. Each window used compiles one chunk shape (plus one for a step's last chunk).
DEFAULT_WINDOWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128,
                   160, 192, 224, 256)

# positions per pass of the non-private step on CPU (`_nonprivate_chunk`): Amazon Games, Transformer, a step's
# 8 physical chunks of 1024 positions (2-core CPU, one process): 2.8-3.0 s in one pass per chunk, 1.9-2.2 s in
# passes of 64-256 positions (the [rows, 23716] logits and softmax of 128 rows, 12 MB, are read and written
# several times per pass)
NONPRIVATE_CPU_ROWS = 128

NEGATIVE_SAMPLERS = ("uniform", "popularity")
ITEM_INITS = ("random", "transitions")
# item_init="transitions" without a declared noise: the item releases alone would spend this share of ε (a public
# rule; under RDP composition the DP-SGD steps' σ then grows by ~10% at ε = 8, not by half)
ITEM_INIT_EPSILON_SHARE = 0.5
DP_SGD_STEP = "DP-SGD step (Poisson-sampled Gaussian)"  # the report's name of the training steps' release


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
    clipping: str = "auto"            # jdp.clipping method ("vmap": the exact per-example reference)
    batch_chunk: int | str | None = "auto"  # users per pass inside each physical chunk: jdp.clipping's batch_chunk
                                      # ("auto": on CPU chunks of 4 users whose per-user embedding gradients are
                                      # kept for the clipped sum, DP epoch 47 s vs 64 s in one pass; None: one
                                      # pass); the non-private reference likewise (`_nonprivate_chunk`)
    d: int = 64
    heads: int = 1
    blocks: int = 2
    dropout: float = 0.5
    activation: str = "relu"
    norm: str = "pre"                 # Transformer blocks: "pre" (SASRec) or "post" (Vaswani et al.'s encoder)
    ffn_dim: int | None = None        # Transformer feed-forward width (None = d)
    item_dim: int | None = None       # vanilla Transformers: item table width r (None = d); r < d adds learned r→d
                                      # and d→r projections (`TransformerRec.item_dim`)
    chunk_rows: int = 1024            # users × window positions per jit call (physical chunk; 1024: ~1.3× the real
                                      # positions on Amazon Games at B = 1024, 2048: ~1.55×, same speed per position)
    hist_noise_multiplier: float = 10.0  # Gaussian histogram noise / sqrt(maxlen+1)
    error_scale: float = 1.0          # multiplies Re-Attention's effective errors (paper: 1)
    eval_every_epochs: float = 0.0    # 0 = only at the end (validation history otherwise)
    mask_history: bool = False
    eval_chunk: int = 1024
    length_buckets: tuple = DEFAULT_WINDOWS  # window lengths for shorter sequences (compute only)
    n_users_public: int | None = None  # declared public bound on the users: sets q = B/N and the steps
    negatives: int = 0                # 0 = full softmax (the paper); K > 0 = sampled softmax, K items per step
    negative_sampler: str = "uniform"  # "uniform" or "popularity" (public or released counts, see train)
    trainable_items: int = 0          # 0 = every item embedding row trains; K > 0 = only the K items with the
                                      # largest public or released counts (`frozen_item_rows`)
    item_init: str = "random"         # "transitions" (beyond the paper): the tied item table starts from ONE
                                      # release of item-to-item transitions (`start_from_item_table`)
    item_init_k: int = 500            # its candidate items (a public choice, as `jdp.seqrec.transitions`' K)
    freeze_item_table: bool = False   # the item table never trains (not differentiated, its noise discarded):
                                      # with item_init="transitions" it keeps the release; DP-SGD trains the rest
    item_init_noise: float | None = None  # its Gaussian noise std (per-user Frobenius norm 1), composed with
                                      # DP-SGD; None: calibrated so that the item releases alone meet
                                      # (ITEM_INIT_EPSILON_SHARE·ε, δ)

    def validate(self) -> None:
        check_privacy(self.epsilon, self.delta, None, unit="user")  # δ < 1/n: in `sampling_plan`
        for name in ("epochs", "lr", "l2_clip", "hist_noise_multiplier"):
            check_positive(getattr(self, name), name)
        check_positive(self.weight_decay, "weight_decay", allow_zero=True)
        check_positive(self.error_scale, "error_scale", allow_zero=True)
        if not 0.0 <= self.warmup_frac < 1.0:
            raise ValueError(f"warmup_frac must be in [0, 1), got {self.warmup_frac}")
        for name in ("batch_size", "chunk_rows", "d", "heads", "blocks", "eval_chunk"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_batch_chunk(self.batch_chunk)
        if int(self.negatives) < 0:
            raise ValueError(f"negatives must be >= 0, got {self.negatives}")
        if int(self.trainable_items) < 0:
            raise ValueError(f"trainable_items must be >= 0, got {self.trainable_items}")
        if self.item_init not in ITEM_INITS:
            raise ValueError(f"item_init must be one of {ITEM_INITS}, got {self.item_init!r}")
        if self.item_init == "transitions":
            if self.model not in ("dpformer", "transformer") or (self.item_dim or self.d) != self.d \
                    or self.norm != "pre" or self.d < 2:
                raise ValueError("item_init='transitions' needs a tied d-wide item table and a final LayerNorm: "
                                 "model 'dpformer' or 'transformer' with norm='pre', d >= 2, without item_dim")
            if int(self.item_init_k) != self.item_init_k or self.item_init_k < 1:
                raise ValueError(f"item_init_k must be a positive integer, got {self.item_init_k}")
            if self.item_init_noise is not None:
                check_positive(self.item_init_noise, "item_init_noise")
        if self.negative_sampler not in NEGATIVE_SAMPLERS:
            raise ValueError(f"negative_sampler must be one of {NEGATIVE_SAMPLERS}, got {self.negative_sampler!r}")
        if self.negatives and self.model == "transformer-untied":
            raise ValueError("a sampled softmax (negatives > 0) needs a tied output embedding")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.ffn_dim is not None and int(self.ffn_dim) < 1:
            raise ValueError(f"ffn_dim must be >= 1, got {self.ffn_dim}")
        if self.item_dim is not None:
            check_item_dim(self.model, self.item_dim, self.d)
        if self.clipping not in CLIPPING_METHODS:
            raise ValueError(f"clipping must be one of {CLIPPING_METHODS}, got {self.clipping!r}")


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
    # what users get without the model, on the same targets (`evaluate.baseline_metrics`)
    baselines: dict = dataclasses.field(default_factory=dict)
    # PRIVATE diagnostics of the steps this call ran, computed from the private data without noise and not covered
    # by the report (never printed by default): `num_nonfinite` = sampled users dropped from their step's sum
    # because their loss or gradient was not finite (they contribute nothing; training goes on regardless)
    private_diagnostics: dict = dataclasses.field(default_factory=dict)


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
    check_privacy(cfg.epsilon, cfg.delta, N, unit="user")  # the one rule: δ < 1/N of the declared users
    return N, cfg.batch_size / N, max(1, int(math.ceil(cfg.epochs * N / cfg.batch_size)))


class PrivacySetup(NamedTuple):
    report: accounting.PrivacyReport | None
    noise_multiplier: float
    item_counts: np.ndarray | None        # for Re-Attention / trainable rows: public or released
    item_start: tr.TransitionModel | None  # item_init="transitions": the release the item table starts from


def privacy_setup(data: SeqData, cfg: TrainConfig, key: jax.Array, public_item_counts: np.ndarray | None = None
                  ) -> PrivacySetup:
    """(report, noise multiplier σ, item counts for Re-Attention, item-table release) for a run of cfg; in a
    NON-PRIVATE run (None, 0, None, the exact transitions or None). DPFormer: caller-declared public counts,
    else a Gaussian histogram release. item_init="transitions": one release of item transitions
    (`jdp.seqrec.transitions.release`, noise std cfg.item_init_noise). The data's vocabulary release
    (vocabulary='private') and these are composed into the same report and σ is calibrated for the total;
    the vocabulary's assumptions (public / exact vocabulary) are stated in the report."""
    cfg.validate()
    start_key = jax.random.fold_in(key, 0x7472)  # the transition release's own noise stream
    if cfg.epsilon is None:
        return PrivacySetup(None, 0.0, None, _item_start(data, cfg, start_key, None, public_item_counts))
    L, M = data.maxlen, data.n_items
    N, q, steps = sampling_plan(data, cfg)
    report = accounting.PrivacyReport(cfg.delta, unit="user", relation=accounting.ADD_OR_REMOVE_ONE)
    if cfg.n_users_public is None:
        report.assume(f"number of users N = {N} treated as public (sets the sampling rate q = B/N and the "
                      "number of steps); declare a public bound with TrainConfig(n_users_public=...)")
    # the vocabulary's own release (private mode) or the assumption it rests on (public / exact)
    for release in data.vocab_releases:
        report.add_release(release)
    for text in data.vocab_assumptions:
        report.assume(text)
    counts_rel = None
    if cfg.model == "dpformer" or cfg.trainable_items:
        if public_item_counts is not None:
            counts_rel = np.asarray(public_item_counts, np.float64)
            if counts_rel.shape != (M + 1,) or not np.isfinite(counts_rel).all():
                raise ValueError(f"public_item_counts must be a finite array of shape ({M + 1},)")
            report.assume("item counts (public_item_counts) declared public by the caller")
        else:
            counts_rel = ra.private_item_counts(key, item_presence(data.train_input, data.train_target, M),
                                                L + 1, cfg.hist_noise_multiplier, report)
    start = _item_start(data, cfg, start_key, report, public_item_counts)
    # DP-SGD's own calibration and report line, its σ calibrated for the steps composed after the releases above
    sigma = calibrate_noise_multiplier(cfg.epsilon, cfg.delta, q, steps,
                                       before=[r.composed_event() for r in report.releases])
    report.add_release(dp_sgd_release(sigma, q, cfg.l2_clip, steps, name=DP_SGD_STEP))
    return PrivacySetup(report, float(sigma), counts_rel, start)


def _item_start(data: SeqData, cfg: TrainConfig, key: jax.Array, report: accounting.PrivacyReport | None,
                public_item_counts: np.ndarray | None) -> tr.TransitionModel | None:
    """item_init="transitions": the transition release the item table starts from, added to `report` (exact
    when report is None: the NON-PRIVATE reference); its candidates are the top item_init_k of its own
    popularity release, or of the declared public counts."""
    if cfg.item_init != "transitions":
        return None
    if cfg.item_init_k > data.n_items:
        raise ValueError(f"item_init_k must be <= the number of items ({data.n_items}), got {cfg.item_init_k}")
    noise_std = cfg.item_init_noise
    if report is not None:
        hist = [] if public_item_counts is not None else [accounting.gaussian_event(tr.HIST_NOISE_MULTIPLIER)]
        if noise_std is None:
            noise_std = accounting.calibrate(lambda s: dpe.ComposedDpEvent(hist + [accounting.gaussian_event(s)]),
                                             ITEM_INIT_EPSILON_SHARE * cfg.epsilon, cfg.delta, bracket=(0.05, 500.0))
        else:
            spent = accounting.compute_epsilon(dpe.ComposedDpEvent(
                [r.composed_event() for r in report.releases] + hist + [accounting.gaussian_event(noise_std)]),
                cfg.delta)
            if spent >= cfg.epsilon:
                raise ValueError(f"the releases before DP-SGD (item table start: item_init_noise={noise_std:g}) "
                                 f"already spend epsilon={spent:.3g} >= {cfg.epsilon:g}: raise item_init_noise "
                                 "or epsilon")
    return tr.release(data, cfg.item_init_k, key, report, noise_std, public_item_counts=public_item_counts)


def start_from_item_table(params, release: tr.TransitionModel):
    """Transformer parameters that start as a scorer of the item-transition `release` (item_init="transitions";
    pre-LN models: the final LayerNorm carries the signs). At the start a user's scores at the last position are

        score_j = Σ_k s_k · x̃_k · E_jk  +  log(c_j / c_min)      (j a candidate; 0 for every other item)

    with E_j the candidate's row of `transitions.item_embedding(release, d - 1)`, s its signs, x̃ the last
    item's row after the LayerNorm (0 for an item outside the candidates: its row starts at 0), and c the
    release's (or public) item counts, c_min the smallest positive among the candidates: a user whose last item
    is a candidate is scored by the release's signed geometry, any other user by popularity. Built as:
    - item table: candidates' rows = [E_j, log(c_j / c_min)/√d], every other row 0;
    - final LayerNorm: scale = [s, 0] (the prior column does not follow the input), bias = [0, √d];
    - position embeddings and each block's residual branch (attention output and fc2 kernels) at 0, so the
      last item's row reaches the output unchanged.
    DP-SGD then trains everything from there. Post-processing of the release."""
    d = int(np.shape(params["params"]["ln_f"]["scale"])[0])
    emb = tr.item_embedding(release, d - 1)
    counts = np.asarray(release.counts, np.float64)[release.items]
    positive = counts[counts > 0]
    c_min = positive.min() if positive.size else 1.0
    prior = np.log(np.maximum(counts, c_min) / c_min)  # ≥ 0: every candidate starts above the other items
    table = np.zeros(np.shape(params["params"]["item_embed"]["embedding"]), np.float32)
    table[release.items] = np.concatenate([emb.rows, prior[:, None] / np.sqrt(d)], axis=1)
    start = {("item_embed", "embedding"): table,
             ("ln_f", "scale"): np.concatenate([emb.signs, [0.0]]).astype(np.float32),
             ("ln_f", "bias"): np.concatenate([np.zeros(d - 1), [np.sqrt(d)]]).astype(np.float32)}

    def begin(path, x):
        names = tuple(getattr(k, "key", None) for k in path)
        if names[-2:] in start:
            return jnp.asarray(start[names[-2:]])
        if names[-2:] == ("pos_embed", "embedding") or names[-3:] == ("attn", "out", "kernel") \
                or names[-2:] == ("fc2", "kernel"):
            return jnp.zeros_like(x)
        return x
    return jax.tree_util.tree_map_with_path(begin, params)


def frozen_item_rows(counts: np.ndarray, trainable: int) -> np.ndarray:
    """Boolean [M+1] mask of the item embedding rows that never train: padding and every item outside the
    `trainable` largest `counts` (ties broken by the lower id).

    Why: DP-SGD adds N(0, σ²C²) to every coordinate of every row, and Adam scales each coordinate by its
    (noise-dominated) second moment, so a row whose items appear in few sequences moves by about the step
    size in a random direction every step and its embedding ends up as noise (sparsity-aware DP training
    of embeddings, e.g. Ghazi et al. 2023, trains only frequent rows). Freezing a row discards the noise
    on it after the release: post-processing, no change to the guarantee when `counts` are public or
    released."""
    counts = np.asarray(counts, np.float64)
    M = counts.size - 1
    if trainable < 1:
        raise ValueError(f"trainable must be >= 1, got {trainable}")
    order = np.argsort(-counts[1:], kind="stable")[:min(int(trainable), M)] + 1
    frozen = np.ones(M + 1, bool)
    frozen[order] = False
    return frozen


def _is_item_embedding(path) -> bool:
    names = [getattr(k, "key", None) for k in path]
    return names[-2:] == ["item_embed", "embedding"]


def freeze_item_table_loss(loss_fn):
    """`loss_fn` that does not differentiate the item table (stop_gradient): each user's gradient, its clipping
    and the noise that reaches the model cover the other parameters only (cfg.freeze_item_table)."""
    def frozen(params, batch, reatt=None):
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: jax.lax.stop_gradient(x) if _is_item_embedding(p) else x, params)
        return loss_fn(params, batch, reatt)
    return frozen


def zero_item_rows(params, frozen: np.ndarray):
    """params with the frozen item embedding rows set to 0: those items enter the model as content-free
    tokens and score 0 in the tied output."""
    keep = jnp.asarray(~frozen, jnp.float32)[:, None]
    return jax.tree_util.tree_map_with_path(lambda p, x: x * keep if _is_item_embedding(p) else x, params)


def freeze_item_rows(frozen: np.ndarray) -> optax.GradientTransformation:
    """Zeroes the optimiser's update of the frozen item embedding rows (after Adam and weight decay)."""
    def update(updates, state, params=None):
        return zero_item_rows(updates, frozen), state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def check_negatives(cfg: TrainConfig, n_items: int, counts_available: bool) -> None:
    """Errors of a sampled-softmax config on a catalogue of n_items (before any work is done)."""
    if cfg.negatives >= n_items:
        raise ValueError(f"negatives must be < the number of items ({n_items}), got {cfg.negatives}")
    if cfg.negative_sampler == "popularity" and cfg.epsilon is not None and not counts_available:
        raise ValueError("popularity negatives in a private run need public_item_counts (declared public) "
                         "or model 'dpformer' (whose released item histogram is then used)")


def negative_probs(data: SeqData, cfg: TrainConfig, counts: np.ndarray | None, public: bool,
                   report: accounting.PrivacyReport | None) -> np.ndarray | None:
    """Sampling distribution [M] over items 1..M of the sampled softmax's negatives (None = uniform), and
    the statement of why it costs no privacy, recorded in the report.

    The K negatives of a step are drawn once from this distribution, independently of the private data
    and shared by every user of the step: given them, each user's clipped gradient depends on that user's
    sequence alone, so the step's sensitivity stays C and nothing new is released. "popularity" uses
    counts that are already public or released: the caller's declared public counts, else DPFormer's
    Gaussian histogram (post-processing); a NON-PRIVATE run uses the exact counts. Add-one smoothing
    keeps every item reachable."""
    K, M = int(cfg.negatives), data.n_items
    check_negatives(cfg, M, counts is not None)
    if cfg.negative_sampler == "uniform":
        probs, source = None, "uniformly from the catalogue"
        counts = None
    else:
        if cfg.epsilon is None:
            counts, source = item_presence(data.train_input, data.train_target, M), "the exact counts (non-private)"
        else:
            source = ("the caller-declared public item counts" if public else
                      "DPFormer's released item histogram (post-processing)")
        if np.shape(counts) != (M + 1,) or not np.isfinite(counts).all():
            raise ValueError(f"item counts for popularity negatives must be finite, of shape ({M + 1},)")
        source = "in proportion to " + source + " (+1)"
        w = np.maximum(np.asarray(counts, np.float64)[1:], 0.0) + 1.0
        probs = w / w.sum()
    if report is not None:
        report.assume(f"sampled softmax: {K} distinct negatives per step drawn {source}, independent of the "
                      "private data given the releases and shared by every user of the step (sensitivity "
                      "unchanged, no extra release)")
    return probs


def sample_negatives(key: jax.Array, n_items: int, k: int, probs: np.ndarray | None) -> np.ndarray:
    """k distinct items in 1..n_items, uniform or with probabilities `probs` [n_items] (Gumbel top-k)."""
    if probs is None:
        return np.asarray(jax.random.choice(key, n_items, (k,), replace=False)) + 1
    g = np.asarray(jax.random.gumbel(key, (n_items,))) + np.log(probs)
    return np.argpartition(-g, k - 1)[:k] + 1


def length_chunks(lengths: np.ndarray, windows: np.ndarray, rows: int) -> list[tuple[int, np.ndarray, int]]:
    """Lays out one sample's users as physical chunks: [(window, positions into `lengths` [P], n_real)].

    Longest users first; a chunk takes the next rows // window users, window = the smallest of `windows`
    (sorted, last = maxlen) that fits the chunk's longest user. Every chunk is full except the last (the
    shortest users), which is padded (repeating its first entry, masked by the caller) to a power of two,
    so a run compiles few shapes; a step that fits in ONE chunk is padded to the full chunk (one shape for
    the whole run: `chunk_rows` ≥ the largest sample × maxlen makes every step a single compiled call).
    Every user is in exactly one chunk."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    out, i = [], 0
    while i < order.size:
        w = int(windows[min(np.searchsorted(windows, lengths[order[i]]), windows.size - 1)])
        full = max(1, rows // w)
        part = order[i:i + full]
        only = i == 0 and part.size == order.size  # the whole step in one chunk
        size = full if part.size == full or only else min(full, 1 << int(np.ceil(np.log2(part.size))))
        out.append((w, np.concatenate([part, np.repeat(part[:1], size - part.size)]), part.size))
        i += part.size
    return out


def step_batches(data: SeqData, idx: np.ndarray, windows: np.ndarray, rows: int, key: jax.Array,
                 negatives: jax.Array | None = None) -> list[tuple[int, dict, jax.Array]]:
    """One step's sampled users `idx` as engine batches [(window, batch, mask)] laid out by `length_chunks`.

    Randomness per user: a dropout key per row (independent draws, whatever the layout). The step's
    `negatives` (sampled softmax) are the same array in every chunk: drawing them per chunk would tie
    a user's gradient to who else shares the chunk, and adding one user moves others between chunks."""
    L = data.maxlen
    out = []
    for c, (w, pos, n_real) in enumerate(length_chunks((data.train_input[idx] > 0).sum(1), windows, rows)):
        users = idx[pos]
        batch = {"input": jnp.asarray(data.train_input[users, L - w:]),
                 "target": jnp.asarray(data.train_target[users, L - w:]),
                 "key": jax.random.split(jax.random.fold_in(key, c), pos.size)}
        if negatives is not None:  # one copy per row (the engine's per-example layout)
            batch["negatives"] = jnp.broadcast_to(negatives, (pos.size, negatives.size))
        out.append((w, batch, jnp.asarray(np.arange(pos.size) < n_real)))
    return out


# TrainConfig fields that change neither a release nor its accounting (evaluation, memory and speed only): a
# resumed run may change them
RESUMABLE_FIELDS = ("eval_every_epochs", "eval_chunk", "mask_history", "batch_chunk", "chunk_rows")


def _digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def run_record(data: SeqData, cfg: TrainConfig, key: jax.Array, public_item_counts: np.ndarray | None) -> dict:
    """What a checkpoint must have been trained with to be resumed: the config (but `RESUMABLE_FIELDS`), digests
    of the key, the training data and the declared public counts. The key's randomness makes the releases (the
    histogram, the item start, every step's noise), so resuming under another key, budget or dataset would
    compose releases that the report does not count, or reuse one noise draw on other data."""
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RESUMABLE_FIELDS}
    key_bits = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    counts = None if public_item_counts is None else _digest(np.asarray(public_item_counts, np.float64))
    return json.loads(json.dumps({"config": config, "key": _digest(np.asarray(key_bits)),
                                  "train_data": _digest(data.train_input, data.train_target, np.int64(data.n_items)),
                                  "public_item_counts": counts},
                                 default=lambda v: v.item() if hasattr(v, "item") else repr(v)))


def _record_file(ckpt: pathlib.Path) -> pathlib.Path:
    return ckpt.with_name(ckpt.name + ".run.json")


def check_resumable(ckpt: pathlib.Path, record: dict) -> None:
    """Raises ValueError unless the checkpoint's run record equals `record` (`run_record`)."""
    path = _record_file(ckpt)
    if not path.exists():
        raise ValueError(f"{ckpt} has no run record ({path.name}): it was written by an older jdp or moved without "
                         "it, so jdp cannot check that resuming it continues the same run; start a new checkpoint")
    saved = json.loads(path.read_text())
    differ = [f"config.{k}" for k in sorted(set(saved.get("config", {})) | set(record["config"]))
              if saved.get("config", {}).get(k) != record["config"].get(k)]
    differ += [k for k in ("key", "train_data", "public_item_counts") if saved.get(k) != record[k]]
    if differ:
        raise ValueError(f"{ckpt} was written by another run (different {', '.join(differ)}): resuming it would "
                         "compose releases that the privacy report does not count. Resume with the same data, "
                         "config and seed, or start a new checkpoint")


def train(data: SeqData, cfg: TrainConfig, key: jax.Array, public_item_counts: np.ndarray | None = None,
          checkpoint: str | pathlib.Path | None = None, checkpoint_every: int | None = None,
          progress: bool = True, evaluate_test: bool = True, max_steps: int | None = None,
          max_seconds: float | None = None, initial_params: Any | None = None,
          show_private_diagnostics: bool = False, time_budget_s: float | None = None) -> TrainResult:
    """Trains cfg.model with DP-SGD at (cfg.epsilon, cfg.delta) and evaluates on valid/test.

    Unit: user (one sequence); relation: add/remove one user. public_item_counts: caller-DECLARED
    public per-item sequence counts [M+1] for Re-Attention (then no histogram is released); otherwise
    DPFormer releases a Gaussian histogram accounted in the report. Exact counts are never used.
    `checkpoint`: a file written every `checkpoint_every` steps (default: every epoch) and at the end,
    and resumed from when it exists (same data, config and key: the run continues as if never stopped; checked
    against the run record written beside it, `run_record`, before any work: ValueError otherwise).
    `max_steps`: stop after this many steps of this call (the noise was calibrated for all `steps`; the
    report covers the steps that ran, see below); resume later from the checkpoint.
    `max_seconds`: stop after the first step that ends this many seconds after the call began (same
    meaning as `max_steps`: a checkpoint is written, the model is evaluated where it stopped).
    `time_budget_s` (`jdp seqrec --max-minutes`): stop at the last epoch boundary before this many seconds
    after the call began, i.e. at an epoch's end when the next epoch (this call's median step time after
    its first step x steps per epoch) would not end within it; after the step that crosses it if the
    estimate was wrong. A checkpoint is written and `timings["stopped"]` says where and why. Time is a public
    quantity: stopping on it reads no data.
    A run stopped before its planned steps (any of the three) reports the epsilon of the steps that ran
    (`partial_report`; the noise was calibrated for all of them, so continuing it spends up to the plan).
    `initial_params`: parameters to start from instead of the model's random initialisation (checked against
    its structure). Their values must be public or post-processing of releases in this run's report (e.g.
    `data.vocab_releases`): the report does not cover anything else they were computed from.

    Every planned step runs whatever the data holds: no property of the private data stops, branches or fails
    the loop. A sampled user whose loss or gradient is not finite contributes nothing to that step's sum (the
    sensitivity bound holds) and is counted in `TrainResult.private_diagnostics["num_nonfinite"]` and in the
    history's epoch entries. The history's `train_loss` and `num_nonfinite` and the sample sizes are PRIVATE
    diagnostics (no noise, not in the report): `progress` shows them only with `show_private_diagnostics=True`.
    """
    cfg.validate()
    if max_seconds is not None:
        check_positive(max_seconds, "max_seconds")
    if time_budget_s is not None:
        check_positive(time_budget_s, "time_budget_s")
    t_start = time.perf_counter()
    plan = sampling_plan(data, cfg)
    ckpt = pathlib.Path(checkpoint) if checkpoint else None
    record = run_record(data, cfg, key, public_item_counts) if ckpt is not None else None
    resuming = ckpt is not None and ckpt.exists()
    if resuming:  # before any work or release
        check_resumable(ckpt, record)
    run = _prepare(data, cfg, plan, key, public_item_counts, resuming, initial_params, evaluate_test)
    start, history = _resume(run, ckpt) if resuming else (0, [])
    stop = run.steps if max_steps is None else min(run.steps, start + int(max_steps))
    loop = _Loop(start, stop, history, per_epoch=max(1, int(math.ceil(run.N / cfg.batch_size))))
    loop.checkpoint_every = loop.per_epoch if checkpoint_every is None else int(checkpoint_every)
    if run.first_step_ready is None:  # else once the first step is compiled (two cores: it comes first)
        run.precompile_evaluation()
    _train_steps(run, loop, t_start, ckpt, record, progress, show_private_diagnostics, max_seconds, time_budget_s)
    run.pool.shutdown(wait=True)  # the evaluation's compilations
    return _evaluated_result(run, loop, ckpt, public_item_counts, evaluate_test, t_start)


@dataclasses.dataclass
class _Run:
    """One call of `train`: what its loop steps with (fixed before it starts) and the loop's state."""
    data: SeqData
    cfg: TrainConfig
    N: int
    q: float
    steps: int
    model: Any
    pool: concurrent.futures.ThreadPoolExecutor
    windows: np.ndarray
    k_noise: jax.Array
    k_sample: jax.Array
    k_dropout: jax.Array
    k_neg: jax.Array
    report: accounting.PrivacyReport | None
    sigma: float
    counts_rel: np.ndarray | None
    item_start: tr.TransitionModel | None
    params: Any                      # the starting parameters (also the evaluation's precompilation shapes)
    neg_probs: np.ndarray | None
    state: Any = None                # DPSGDState (or the reference's _PlainState)
    accumulate: Any = None
    apply: Any = None
    apply_ready: Any = None          # futures of compilations beside the first step
    first_step_ready: Any = None
    reatt: dict | None = None
    rank_fn: Any = None
    eval_windows: tuple = ()
    eval_shapes: list = dataclasses.field(default_factory=list)

    @property
    def private(self) -> bool:
        return self.cfg.epsilon is not None

    def precompile_evaluation(self) -> None:
        for shape in self.eval_shapes:
            self.pool.submit(_precompile, self.rank_fn, self.params, *shape)

    def epsilon_after(self, done: int) -> float:
        """ε of the releases before training and `done` DP-SGD steps (privacy_setup appends the steps last)."""
        fixed = [r.composed_event() for r in self.report.releases[:-1]]
        return accounting.compute_epsilon(dpe.ComposedDpEvent(fixed + [dp_sgd_event(self.sigma, self.q, done)]),
                                          self.cfg.delta)


@dataclasses.dataclass
class _Loop:
    """Where `train`'s loop stands: steps [start, stop) of this call, the history, the private diagnostics."""
    start: int
    stop: int
    history: list
    per_epoch: int
    checkpoint_every: int = 0
    t_train: float = 0.0
    epoch_loss: float = 0.0
    epoch_count: int = 0
    epoch_nonfinite: int = 0         # private diagnostics: users dropped for a non-finite loss/gradient
    total_nonfinite: int = 0
    stopped: dict | None = None      # why and where a run ended before its planned steps (public: steps and time)
    step_s: list = dataclasses.field(default_factory=list)            # per-step time
    shapes_seen: set = dataclasses.field(default_factory=set)
    step_new_shapes: list = dataclasses.field(default_factory=list)   # steps that compiled a new chunk shape


def _prepare(data: SeqData, cfg: TrainConfig, plan: tuple[int, float, int], key: jax.Array, public_item_counts,
             resuming: bool, initial_params, evaluate_test: bool) -> _Run:
    """Everything before `train`'s loop: the model, the releases and σ (`privacy_setup`), the starting parameters,
    the step functions (`dp_sgd`'s accumulate / apply, or the NON-PRIVATE reference's) and the evaluation."""
    (N, q, steps), L, M = plan, data.maxlen, data.n_items
    if public_item_counts is not None and (cfg.model == "dpformer" or cfg.trainable_items):  # validate first
        if np.shape(public_item_counts) != (M + 1,):
            raise ValueError(f"public_item_counts must be a finite array of shape ({M + 1},)")
    if cfg.negatives:  # fail before any work (the accounting below takes seconds)
        check_negatives(cfg, M, cfg.model == "dpformer" or public_item_counts is not None)
    model = make_model(cfg.model, M, L, cfg.d, cfg.heads, cfg.blocks, cfg.dropout, cfg.activation, cfg.norm,
                       cfg.ffn_dim, cfg.item_dim)
    k_init, k_hist, k_train = jax.random.split(key, 3)

    # compilations off the critical path: XLA releases the GIL while it compiles, so on a first run the
    # calibration and the initialisation's compilation overlap the first step's clipped accumulation (its program
    # does not read σ), and the update's and the evaluation's compilations overlap the first step (`_precompile`)
    pool = concurrent.futures.ThreadPoolExecutor(3, thread_name_prefix="jdp-compile")
    init = pool.submit(jax.jit(model.init), k_init, jnp.zeros((1, L), jnp.int32))
    k_noise, k_sample, k_dropout = jax.random.split(k_train, 3)
    windows = np.array(sorted({int(b) for b in cfg.length_buckets if 0 < b < L} | {L}))
    loss_fn = _loss_of(model, cfg)
    first_step_ready = None
    if cfg.epsilon is not None and not cfg.negatives and not resuming:
        # traced here, before the calibration starts: both are Python and would take turns on the GIL
        lowered = _lower_first_step(data, cfg, model, loss_fn, k_init, N, q, windows, k_sample, k_dropout)
        first_step_ready = pool.submit(lambda: [program.compile() for program in lowered])
    report, sigma, counts_rel, item_start = pool.submit(privacy_setup, data, cfg, k_hist, public_item_counts).result()
    run = _Run(data, cfg, N, q, steps, model, pool, windows, k_noise, k_sample, k_dropout,
               jax.random.fold_in(k_train, 0x6E6567),  # negatives' own stream (data-independent)
               report, sigma, counts_rel, item_start, init.result(), None, first_step_ready=first_step_ready)
    frozen = _starting_params(run, initial_params, public_item_counts)
    log_q = None
    if cfg.negatives:
        run.neg_probs = negative_probs(data, cfg, counts_rel if cfg.model == "dpformer" else public_item_counts,
                                       public_item_counts is not None, report)
        if run.neg_probs is not None:
            log_q = jnp.log(jnp.asarray(np.concatenate([[1.0], run.neg_probs]), jnp.float32))
    _step_functions(run, _loss_of(model, cfg, log_q=log_q) if log_q is not None else loss_fn, frozen)
    _evaluation(run, evaluate_test)
    return run


def _loss_of(model, cfg: TrainConfig, **kw):
    """The model's per-user loss (Re-Attention's inputs: an input of the step, `aux`, not a constant)."""
    loss = make_loss_fn(model, **kw)
    return freeze_item_table_loss(loss) if cfg.freeze_item_table else loss


def _starting_params(run: _Run, initial_params, public_item_counts) -> np.ndarray | None:
    """Sets run.params (the caller's, the item-table start or the model's initialisation, frozen item rows at 0);
    returns the frozen item rows (None: every row trains)."""
    cfg, data, M = run.cfg, run.data, run.data.n_items
    if initial_params is not None:  # the caller's starting point (public, or post-processing of a release)
        run.params = _check_initial_params(initial_params, run.params)
    elif run.item_start is not None:
        run.params = start_from_item_table(run.params, run.item_start)
    frozen = None
    if cfg.trainable_items:  # post-processing of public / released counts (exact only in a NON-PRIVATE run)
        counts = (run.counts_rel if run.private else public_item_counts if public_item_counts is not None
                  else item_presence(data.train_input, data.train_target, M))
        frozen = frozen_item_rows(counts, cfg.trainable_items)
        run.params = zero_item_rows(run.params, frozen)
    if cfg.freeze_item_table:  # not differentiated (freeze_item_table_loss); the noise drawn for it is discarded
        frozen = np.ones(M + 1, bool)
    return frozen


def _step_functions(run: _Run, loss_fn, frozen) -> None:
    """The optimiser, the DP-SGD step of jdp.clipping (`dp_sgd` at the σ of `privacy_setup`: its accumulate and
    apply) or the NON-PRIVATE reference's, the starting state, and Re-Attention's inputs."""
    cfg, M = run.cfg, run.data.n_items
    opt = optax.adamw(lr_schedule(cfg.lr, run.steps, cfg.warmup_frac), weight_decay=cfg.weight_decay)
    if frozen is not None:
        opt = optax.chain(opt, freeze_item_rows(frozen))
    if jnp.issubdtype(run.k_noise.dtype, jax.dtypes.prng_key):
        run.k_noise = jax.random.key_data(run.k_noise)  # raw key bits: the noise key lives in opt_state
    if run.private:
        dp = dp_sgd(loss_fn, opt, num_examples=run.N, batch_size=cfg.batch_size, l2_clip=cfg.l2_clip,
                    delta=cfg.delta, steps=run.steps, noise_multiplier=run.sigma, method=cfg.clipping,
                    normalize=cfg.normalize, unit="user", batch_chunk=cfg.batch_chunk)
        run.accumulate, run.apply = dp.accumulate, dp.apply
        # the noisy update compiles as soon as σ is known, beside the state's allocation and the steps below
        state_shape = jax.eval_shape(dp.init, run.params, run.k_noise)
        run.apply_ready = run.pool.submit(_precompile, run.apply, state_shape, state_shape.params)
        run.state = jax.jit(dp.init)(run.params, run.k_noise)  # one program, not an eager op per leaf
    else:  # NON-PRIVATE reference: plain gradient sums, the same sampling, schedule and optimiser
        run.state, run.accumulate, run.apply = _nonprivate_step(loss_fn, opt, run.params, cfg.batch_size,
                                                                cfg.batch_chunk)
        run.apply_ready = run.pool.submit(_precompile, run.apply, run.state, run.state.params)
    if cfg.model == "dpformer":
        if run.counts_rel is None:  # non-private reference: zero noise -> Re-Attention is the identity
            run.counts_rel = np.ones(M + 1)
        run.reatt = _reatt_inputs(*ra.effective_variances(run.sigma, cfg.l2_clip, cfg.batch_size, run.q,
                                                          run.counts_rel, cfg.error_scale))


def _evaluation(run: _Run, evaluate_test: bool) -> None:
    """The ranking function and the shapes the evaluation will compile."""
    cfg, data = run.cfg, run.data
    # one compilation for every evaluation; the test metrics under the other history protocol come from
    # the same forward pass
    run.rank_fn = make_rank_fn_reatt(run.model, cfg.mask_history, run.reatt, both_protocols=True)
    # evaluation is one forward per user: the powers of two among the windows cost little extra compute
    # and save most compilations (each window x chunk size is one; they dominate evaluation on a GPU)
    run.eval_windows = tuple(int(w) for w in cfg.length_buckets if int(w) > 0 and int(w) & (int(w) - 1) == 0)
    run.eval_shapes = evaluation_shapes([data.valid_input] + ([data.test_input] if evaluate_test else []),
                                        [data.valid_target] + ([data.test_target] if evaluate_test else []),
                                        cfg.eval_chunk, run.eval_windows)


def _resume(run: _Run, ckpt: pathlib.Path) -> tuple[int, list]:
    """(steps done, history) of the checkpoint; run.state from it (its noise key from the run's key)."""
    state = flax.serialization.from_bytes(run.state, ckpt.read_bytes())
    if run.private:  # the file holds no noise key (`without_noise_key`): it follows from the run's key
        state = with_noise_key(state, run.k_noise)
    run.state = state
    start = int(state.step)
    hist_file = ckpt.with_name(ckpt.name + ".history.json")
    history = []
    if hist_file.exists():
        history = [h for h in json.loads(hist_file.read_text()) if h["step"] <= start]
    return start, history


def _one_step(run: _Run, loop: _Loop, step: int, zero) -> tuple:
    """DP-SGD step `step`: its Poisson sample laid out by length, each chunk's clipped sum accumulated, then the noisy
    update. Returns (sample size, loss sum, count, non-finite count): private diagnostics."""
    cfg, data = run.cfg, run.data
    k_step = jax.random.fold_in(run.k_sample, step)
    idx = poisson_indices(k_step, run.N, run.q)  # the rule of every jdp DP-SGD step (same for the reference)
    idx = idx[idx < data.n_users]  # ids of the declared population without data contribute nothing
    kd = jax.random.fold_in(run.k_dropout, step)
    acc, loss_sum, count, nonfinite = zero, 0.0, 0, 0
    negs = (jnp.asarray(sample_negatives(jax.random.fold_in(run.k_neg, step), data.n_items, cfg.negatives,
                                         run.neg_probs)) if cfg.negatives else None)
    chunks = step_batches(data, idx, run.windows, cfg.chunk_rows, kd, negs)
    if run.first_step_ready is not None:  # calling `accumulate` while it compiles would compile it twice
        run.first_step_ready.result()
        run.first_step_ready = None
        run.precompile_evaluation()
    new = {(w, int(mask.size)) for w, _, mask in chunks} - loop.shapes_seen
    loop.shapes_seen |= new
    loop.step_new_shapes.append(len(new))
    for _, batch, mask in chunks:
        acc, sums = run.accumulate(run.state.params, acc, batch, mask, run.reatt)
        loss_sum, count = loss_sum + sums["loss_sum"], count + sums["count"]
        nonfinite = nonfinite + sums["num_nonfinite"]
    if run.apply_ready is not None:  # compiled beside the first step (calling it meanwhile would compile it twice)
        run.apply_ready.result()
        run.apply_ready = None
    run.state = run.apply(run.state, acc)
    return idx.size, loss_sum, count, nonfinite


def _history_entry(run: _Run, loop: _Loop, done: int) -> dict | None:
    """The history's entry after step `done`: at an epoch's end (train_loss, num_nonfinite: private; ε spent) and
    at a validation point."""
    cfg, N = run.cfg, run.N
    entry = None
    if done % loop.per_epoch == 0 or done == run.steps:
        entry = {"step": done, "epoch": done * cfg.batch_size / N,  # train_loss, num_nonfinite: private
                 "train_loss": loop.epoch_loss / max(loop.epoch_count, 1), "num_nonfinite": loop.epoch_nonfinite}
        if run.private:
            entry["epsilon_spent"] = run.epsilon_after(done)
        loop.epoch_loss, loop.epoch_count, loop.epoch_nonfinite = 0.0, 0, 0
    eval_every = (max(1, int(round(cfg.eval_every_epochs * loop.per_epoch))) if cfg.eval_every_epochs > 0
                  else 0)
    if eval_every and done % eval_every == 0 and done < run.steps:
        m = evaluate(run.model, run.state.params, run.data.valid_input, run.data.valid_target,
                     chunk=cfg.eval_chunk, rank_fn=run.rank_fn, length_buckets=run.eval_windows)
        entry = {**(entry or {"step": done, "epoch": done * cfg.batch_size / N}),
                 "ndcg_at_10_valid": m["ndcg"], "hit_at_10_valid": m["hit"]}
    return entry


def _train_steps(run: _Run, loop: _Loop, t_start: float, ckpt, record, progress: bool,
                 show_private_diagnostics: bool, max_seconds, time_budget_s) -> None:
    """`train`'s loop: every step of [loop.start, loop.stop) unless time runs out (public), checkpoints."""
    private_keys = ("train_loss", "num_nonfinite")  # history entries shown only with show_private_diagnostics
    zero = jax.tree_util.tree_map(jnp.zeros_like, run.state.params)
    it = tqdm(range(loop.start, loop.stop), desc=f"{run.cfg.model} eps={run.cfg.epsilon}", disable=not progress,
              initial=loop.start, total=run.steps)
    for step in it:
        t0 = time.perf_counter()
        n_sampled, loss_sum, count, nonfinite = _one_step(run, loop, step, zero)
        # such users contributed nothing (the bound holds); the run goes on: a private count, never a branch
        loop.epoch_nonfinite += int(nonfinite)
        loop.total_nonfinite += int(nonfinite)
        loop.epoch_loss, loop.epoch_count = loop.epoch_loss + float(loss_sum), loop.epoch_count + int(count)
        loop.step_s.append(time.perf_counter() - t0)
        loop.t_train += loop.step_s[-1]
        if show_private_diagnostics:  # the sample's loss and size are private: opt-in only
            it.set_postfix(loss=f"{float(loss_sum) / max(int(count), 1):.3f}", batch=n_sampled,
                           nonfinite=int(nonfinite))
        done = step + 1
        entry = _history_entry(run, loop, done)
        if entry is not None:
            loop.history.append(entry)
            if progress:
                it.write("  ".join(_progress_item(k, v) for k, v in entry.items()
                                   if show_private_diagnostics or k not in private_keys))
        out_of_time = _out_of_time(loop, done, time.perf_counter() - t_start, max_seconds, time_budget_s)
        if ckpt is not None and (done % loop.checkpoint_every == 0 or done == loop.stop or out_of_time):
            ckpt.write_bytes(flax.serialization.to_bytes(without_noise_key(run.state)))
            ckpt.with_name(ckpt.name + ".history.json").write_text(json.dumps(loop.history))
            _record_file(ckpt).write_text(json.dumps(record))
        if out_of_time:
            loop.stop = done
            break


def _out_of_time(loop: _Loop, done: int, elapsed: float, max_seconds, time_budget_s) -> bool:
    """Whether the loop stops after step `done` for time (public: never the data); sets loop.stopped."""
    out_of_time = max_seconds is not None and elapsed >= max_seconds
    if time_budget_s is not None and done < loop.stop and not out_of_time:
        if budget_says_stop(elapsed, done, loop.per_epoch, loop.step_s, time_budget_s):
            out_of_time = True
            loop.stopped = {"reason": "time budget", "at_epoch_boundary": done % loop.per_epoch == 0,
                            "budget_s": time_budget_s, "elapsed_s": elapsed}
    if out_of_time and loop.stopped is None:
        loop.stopped = {"reason": "time limit (max_seconds)", "at_epoch_boundary": done % loop.per_epoch == 0}
    return out_of_time


def _evaluated_result(run: _Run, loop: _Loop, ckpt, public_item_counts, evaluate_test: bool, t_start: float
                      ) -> TrainResult:
    """The TrainResult after the loop: the report of the steps that ran, the metrics beside the baselines."""
    cfg, N, steps, report = run.cfg, run.N, run.steps, run.report
    params, steps_done = run.state.params, int(run.state.step)
    stopped = loop.stopped
    if steps_done < steps:
        stopped = {**(stopped or {"reason": "max_steps", "at_epoch_boundary": steps_done % loop.per_epoch == 0}),
                   "step": steps_done, "planned_steps": steps, "epoch": steps_done * cfg.batch_size / N,
                   "checkpoint": None if ckpt is None else str(ckpt)}
        if report is not None:  # the release is the model after the steps that ran: their epsilon, not the plan's
            report = partial_report(report, steps_done, steps)
    t0 = time.perf_counter()
    metrics, baselines = _metrics(run, params, public_item_counts, evaluate_test)
    t_eval = time.perf_counter() - t0
    timings = {"train_s": loop.t_train, "eval_s": t_eval, "total_s": time.perf_counter() - t_start,
               "steps_run": loop.stop - loop.start, "steps_done": steps_done,
               "epochs_done": steps_done * cfg.batch_size / N,
               "s_per_step": loop.t_train / max(1, loop.stop - loop.start), "step_s": loop.step_s,
               "step_new_shapes": loop.step_new_shapes,
               "complete": steps_done == steps, **({"stopped": stopped} if stopped is not None else {})}
    return TrainResult(params, metrics, report, float(run.sigma), steps, loop.history, timings, run.reatt,
                       run.counts_rel, baselines, private_diagnostics={"num_nonfinite": loop.total_nonfinite})


def _metrics(run: _Run, params, public_item_counts, evaluate_test: bool) -> tuple[dict, dict]:
    """(metrics, baselines): NDCG / HIT at 10 on the validation (and test) users, and what users get without the
    model on the same targets."""
    cfg, data = run.cfg, run.data
    mv = evaluate(run.model, params, data.valid_input, data.valid_target, chunk=cfg.eval_chunk, rank_fn=run.rank_fn,
                  length_buckets=run.eval_windows)
    metrics = {"ndcg_at_10_valid": mv["ndcg"], "hit_at_10_valid": mv["hit"], "n_valid_users": mv["n_users"]}
    if evaluate_test:
        mt = evaluate(run.model, params, data.test_input, data.test_target, chunk=cfg.eval_chunk,
                      rank_fn=run.rank_fn, length_buckets=run.eval_windows)
        metrics.update({"ndcg_at_10_test": mt["ndcg"], "hit_at_10_test": mt["hit"], "n_test_users": mt["n_users"]})
        # the other protocol too (papers differ on it): history items removed from / kept in the ranking
        other = "history_unmasked" if cfg.mask_history else "history_masked"
        metrics.update({f"ndcg_at_10_test_{other}": mt["other"]["ndcg"],
                        f"hit_at_10_test_{other}": mt["other"]["hit"]})
    # zero cost (each user's own history) and, from public or already released counts, popularity: DPFormer's
    # histogram, else the item-table start's own popularity release (post-processing either way)
    popular = public_item_counts
    if popular is None and run.private:
        popular = (run.counts_rel if run.counts_rel is not None
                   else run.item_start.counts if run.item_start is not None else None)
    baselines = baseline_metrics(data, popular, splits=("valid", "test") if evaluate_test else ("valid",))
    return metrics, baselines


def _progress_item(key: str, value) -> str:
    """One item of a progress line: NDCG / HIT in percent (the unit every printed metric of jdp seqrec uses)."""
    if key.startswith(("ndcg", "hit")) and isinstance(value, float):
        return f"{key.replace('_at_10', '@10')} {100 * value:.2f}%"
    return f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"


def budget_says_stop(elapsed: float, done: int, per_epoch: int, step_s: list[float], budget_s: float) -> bool:
    """Whether a run with a time budget stops after step `done`: once the budget is spent, and at an epoch's end
    when the next epoch, estimated from the median time of this call's steps after its first (which compiles),
    would end past it. Reads only time and step counts (public)."""
    if elapsed >= budget_s:
        return True
    if done % per_epoch or not step_s:
        return False
    typical = float(np.median(step_s[1:] if len(step_s) > 1 else step_s))
    return elapsed + typical * per_epoch > budget_s


def partial_report(report: accounting.PrivacyReport, steps_done: int, steps: int) -> accounting.PrivacyReport:
    """The report of a run stopped after `steps_done` of its `steps` planned DP-SGD steps: every release before
    training as planned, the DP-SGD step (the last release, `privacy_setup`) counted `steps_done` times."""
    ran = dataclasses.replace(report, releases=list(report.releases[:-1]), assumptions=list(report.assumptions))
    if steps_done > 0:
        ran.add_release(dataclasses.replace(report.releases[-1], count=int(steps_done)))
    ran.assume(f"the run stopped after {steps_done} of its {steps} planned DP-SGD steps: epsilon covers the steps "
               "that ran (the noise was calibrated for all of them; continuing it spends up to the planned epsilon)")
    return ran


def _check_initial_params(initial, reference):
    """`initial` as float32 arrays, after checking it has `reference`'s tree structure and leaf shapes."""
    if jax.tree_util.tree_structure(initial) != jax.tree_util.tree_structure(reference):
        raise ValueError("initial_params must have the model's parameter structure (model.init's)")
    pairs = zip(jax.tree_util.tree_flatten_with_path(initial)[0], jax.tree_util.tree_leaves(reference))
    bad = [jax.tree_util.keystr(path) for (path, a), b in pairs if np.shape(a) != np.shape(b)]
    if bad:
        raise ValueError(f"initial_params: wrong shape at {', '.join(bad)}")
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), initial)


def _reatt_inputs(w_var, emb_var) -> dict:
    """Re-Attention's released variances as the step's `aux` input (values, not constants of the program)."""
    return {"w_var": jnp.float32(w_var), "emb_var": jnp.asarray(emb_var, jnp.float32)}


def _lower_first_step(data, cfg, model, loss_fn, k_init, N, q, windows, k_sample, k_dropout) -> list:
    """The clipped accumulation of the first step's chunk shapes (the sample is Poisson at rate q, known before σ),
    traced and lowered on abstract parameters: the same jitted function `dp_sgd(...).accumulate` returns later, so
    compiling these fills its cache."""
    L, M = data.maxlen, data.n_items
    params = jax.eval_shape(model.init, k_init, jnp.zeros((1, L), jnp.int32))
    aux = jax.eval_shape(_reatt_inputs, 1.0, np.ones(M + 1, np.float32)) if cfg.model == "dpformer" else None
    accumulate = clipped_accumulate(loss_fn, float(cfg.l2_clip), cfg.clipping, bool(cfg.normalize), cfg.batch_chunk)
    idx = poisson_indices(jax.random.fold_in(k_sample, 0), N, q)
    idx = idx[idx < data.n_users]
    shapes = {}
    for _, batch, mask in step_batches(data, idx, windows, cfg.chunk_rows, jax.random.fold_in(k_dropout, 0)):
        spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (batch, mask))
        shapes[(batch["input"].shape, mask.shape)] = spec
    return [accumulate.lower(params, params, batch, mask, aux) for batch, mask in shapes.values()]


def _precompile(fn, *args) -> None:
    """Compiles the jitted `fn` (or a functools.partial of one) for `args` (arrays or ShapeDtypeStructs) into its
    own cache, so a later call of the same shapes runs at once."""
    if isinstance(fn, functools.partial):
        fn.func.lower(*fn.args, *args, **fn.keywords).compile()
    else:
        fn.lower(*args).compile()


class _PlainState(NamedTuple):
    params: Any
    opt_state: Any
    step: jax.Array


def _nonprivate_chunk(batch_chunk, B: int, L: int) -> int:
    """Users per pass of the non-private step: `batch_chunk` as in `jdp.clipping` (None: the whole physical
    chunk); "auto" on CPU: about NONPRIVATE_CPU_ROWS positions, so a pass's [rows, M+1] logits and softmax stay
    in cache instead of streaming through memory several times (elsewhere: the whole chunk)."""
    if batch_chunk is None:
        return B
    if batch_chunk == "auto":
        return B if jax.default_backend() != "cpu" else min(B, max(1, NONPRIVATE_CPU_ROWS // L))
    return min(B, int(batch_chunk))


def _nonprivate_step(loss_fn, opt, params, batch_size: float, batch_chunk: int | str | None = "auto"):
    """NON-PRIVATE reference twin of DPSGD.accumulate / apply: unclipped gradient sums, no noise, divided
    by the expected batch size like the private step. Each physical chunk runs as a loop over passes of
    `_nonprivate_chunk` users (the private engine's `batch_chunk`), the gradient sum in the loop's carry."""
    tx = optax.chain(optax.scale(1.0 / batch_size), opt)

    def grad_sum(params, batch, keep, aux):
        return jax.value_and_grad(lambda p: jnp.sum(jnp.where(keep, loss_fn(p, batch, aux), 0.0)))(params)

    @jax.jit
    def accumulate(params, acc, batch, mask, aux=None):
        keep = jnp.asarray(mask)
        B, L = batch["input"].shape
        chunk = _nonprivate_chunk(batch_chunk, B, L)
        if chunk >= B:
            loss, g = grad_sum(params, batch, keep, aux)
        else:
            def one(carry, part):
                l, g = grad_sum(params, *part, aux)
                return (carry[0] + l, jax.tree_util.tree_map(jnp.add, carry[1], g)), None
            (loss, g), _ = jax.lax.scan(one, (jnp.zeros(()), jax.tree_util.tree_map(jnp.zeros_like, params)),
                                        split_into_chunks(batch, keep, chunk))
        sums = {"loss_sum": loss, "count": jnp.sum(keep), "num_nonfinite": jnp.int32(0)}
        return jax.tree_util.tree_map(jnp.add, acc, g), sums

    @jax.jit
    def apply(state, acc):
        upd, opt_state = tx.update(acc, state.opt_state, state.params)
        return _PlainState(optax.apply_updates(state.params, upd), opt_state, state.step + 1)

    return _PlainState(params, tx.init(params), jnp.zeros((), jnp.int32)), accumulate, apply


__all__ = ["DEFAULT_WINDOWS", "ITEM_INITS", "NEGATIVE_SAMPLERS", "PrivacySetup", "TrainConfig", "TrainResult", "check_negatives", "dp_sgd_event",
           "length_chunks", "lr_schedule", "negative_probs", "freeze_item_table_loss", "privacy_setup", "sample_negatives", "start_from_item_table", "step_batches", "train"]
