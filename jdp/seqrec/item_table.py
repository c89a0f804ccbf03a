"""The tied item table's post-processing: its start from the item-transition release (`start_from_item_table`),
the rows that never train (`frozen_item_rows`, `zero_item_rows`, `freeze_item_rows`) and a table that is never
differentiated (`freeze_item_table_loss`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdp.seqrec import transitions as tr


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


def is_item_embedding(path) -> bool:
    names = [getattr(k, "key", None) for k in path]
    return names[-2:] == ["item_embed", "embedding"]


def freeze_item_table_loss(loss_fn):
    """`loss_fn` that does not differentiate the item table (stop_gradient): each user's gradient, its clipping
    and the noise that reaches the model cover the other parameters only (cfg.freeze_item_table)."""
    def frozen(params, batch, reatt=None):
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: jax.lax.stop_gradient(x) if is_item_embedding(p) else x, params)
        return loss_fn(params, batch, reatt)
    return frozen


def zero_item_rows(params, frozen: np.ndarray):
    """params with the frozen item embedding rows set to 0: those items enter the model as content-free
    tokens and score 0 in the tied output."""
    keep = jnp.asarray(~frozen, jnp.float32)[:, None]
    return jax.tree_util.tree_map_with_path(lambda p, x: x * keep if is_item_embedding(p) else x, params)


def freeze_item_rows(frozen: np.ndarray) -> optax.GradientTransformation:
    """Zeroes the optimiser's update of the frozen item embedding rows (after Adam and weight decay)."""
    def update(updates, state, params=None):
        return zero_item_rows(updates, frozen), state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


__all__ = ["freeze_item_rows", "freeze_item_table_loss", "frozen_item_rows", "is_item_embedding",
           "start_from_item_table", "zero_item_rows"]
