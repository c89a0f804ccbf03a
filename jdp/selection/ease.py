"""EASE recommendation scores as selection problems (the paper's real-data experiment, with dense EASE
in place of its sparse approximation SANSA).

EASE (Steck 2019): G = XᵀX + λI, P = G⁻¹, B = I − P·diag(1/diag P) (zero diagonal), scores S = XB.
Per user the candidates are the `top` highest-scoring unseen items; the per-item sensitivity is the
spread of the predicted score across users (q_hi − q_lo quantiles of column S[:, i]) with a small floor
for near-constant items. These sensitivities are computed from the training data and DECLARED PUBLIC,
as in the paper's experiment; a deployment must privatise them (e.g. `bandit.dp_quantile`) or take them
from public data. The experiment measures utility only.
"""
from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np


def read_ml100k(path) -> np.ndarray:
    """u.data (user, item, rating, ts) -> interaction pairs [n, 2] (0-based), ratings ≥ 4 kept."""
    raw = np.loadtxt(pathlib.Path(path), dtype=np.int64)
    keep = raw[:, 2] >= 4
    return raw[keep][:, :2] - 1


def read_pairs(path) -> np.ndarray:
    """SASRec format, one `user item` pair per line (1-based ids) -> [n, 2] 0-based."""
    return np.loadtxt(pathlib.Path(path), dtype=np.int64)[:, :2] - 1


def interaction_matrix(pairs: np.ndarray, max_items: int | None = None, min_user_items: int = 5) -> np.ndarray:
    """Binary user × item matrix (float32). `max_items` keeps the most popular items (dense EASE is
    O(items³)); users with fewer than `min_user_items` kept interactions are dropped."""
    users, items = pairs[:, 0], pairs[:, 1]
    if max_items is not None:
        pop = np.bincount(items)
        keep_items = np.argsort(-pop, kind="stable")[:max_items]
        remap = -np.ones(pop.size, np.int64)
        remap[keep_items] = np.arange(keep_items.size)
        items = remap[items]
        users = users[items >= 0]
        items = items[items >= 0]
    n_users, n_items = users.max() + 1, items.max() + 1
    x = np.zeros((n_users, n_items), np.float32)
    x[users, items] = 1.0
    return x[x.sum(1) >= min_user_items]


@jax.jit
def ease_weights(x: jax.Array, lam: float) -> jax.Array:
    """B = I − P·diag(1/diag P), P = (XᵀX + λI)⁻¹; [items, items] float32."""
    g = x.T @ x + lam * jnp.eye(x.shape[1], dtype=x.dtype)
    p = jnp.linalg.inv(g)
    b = -p / jnp.diag(p)[None, :]
    return b.at[jnp.diag_indices_from(b)].set(0.0)


def selection_problems(x: np.ndarray, lam: float = 300.0, top: int = 500, users: int | None = None,
                       seed: int = 0, q_lo: float = 0.05, q_hi: float = 0.95, floor: float = 1e-3):
    """Returns (scores [U, top], sensitivities [U, top], item ids [U, top], per-item Δ [items]).

    Sensitivity of item i = quantile spread of S[:, i] over all users (floored at `floor`·max spread);
    `users` subsamples the users whose problems are returned (seeded)."""
    x = jnp.asarray(x)
    s = x @ ease_weights(x, lam)
    spread = jnp.quantile(s, q_hi, axis=0) - jnp.quantile(s, q_lo, axis=0)
    delta = jnp.maximum(spread, floor * jnp.max(spread))
    rows = np.arange(x.shape[0])
    if users is not None and users < rows.size:
        rows = np.sort(np.random.default_rng(seed).choice(rows, users, replace=False))
    su = jnp.where(x[rows] > 0, -jnp.inf, s[rows])  # unseen items only
    top = min(top, int(x.shape[1]))
    scores, ids = jax.lax.top_k(su, top)
    return (np.asarray(scores, np.float64), np.asarray(delta[ids], np.float64), np.asarray(ids),
            np.asarray(delta))
