"""Private item-to-item transitions: a sequential recommender trained by ONE Gaussian release (user-level DP).

Unit: a user (one training sequence); relation: add/remove a user. K candidate items are the top K of item
counts declared public or released in the same report (a Gaussian histogram of each user's distinct items
weighted 1/sqrt(their number), L2 sensitivity 1): post-processing picks the candidates. Each user's
transitions s_t -> s_t+1 between candidates form a count matrix scaled to Frobenius norm 1 (0 for a user
without such a transition), so the [K, K] sum over users changes by at most 1 in Frobenius norm when one user
is added or removed: the Gaussian mechanism with L2 sensitivity 1 releases it, and that release is the whole
model. A user is scored by the rows of the candidates among their last `history` items (summed); the released
counts break ties (a user without a candidate in that window gets the popularity ranking of the release), and
items outside the candidates rank last.

It exists because DP-SGD on a 23,716-row item table learns little beyond popularity at these ε
(benchmarks/seqrec/README.md): one release pools every user's transitions into the rows that carry them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import dp_accounting.dp_event as dpe
import jax
import numpy as np

from jdp import accounting, noise
from jdp.seqrec import data as D
from jdp.seqrec.evaluate import ndcg_hit_from_ranks
from jdp.validation import check_positive, check_privacy

HIST_NOISE_MULTIPLIER = 4.0  # the popularity release's noise std (per-user norm 1): top few hundred items stand out
# `default_k`: K = K_PER_ROOT · √(N/σ). Each user's transitions carry Frobenius norm 1 over the K² cells, so a
# cell's signal grows like N/K² against noise σ: the same signal-to-noise at every N and ε means K ∝ √(N/σ). The
# constant is fitted once to the validation grids of Amazon Games (N = 31,013: best K 500 / 500 / 1000 ≈ 500 at
# ε = 5 / 8 / 10) and ML-100K (N = 943: 100 at ε = 5 and 8) (benchmarks/seqrec/README.md#transitions): a public
# rule, not a choice on the private data of a run.
K_PER_ROOT = 2.5


def user_sequences(inputs: np.ndarray, targets: np.ndarray) -> list[np.ndarray]:
    """Each user's training sequence in time order: the input row without padding, then its last target."""
    out = []
    for x, t in zip(np.asarray(inputs), np.asarray(targets)):
        out.append(np.concatenate([x[x > 0], t[-1:][t[-1:] > 0]]))
    return out


def transition_sum(sequences: list[np.ndarray], candidates: np.ndarray, n_items: int) -> np.ndarray:
    """Σ over users of each user's candidate-to-candidate transition counts scaled to Frobenius norm 1:
    [K, K], row = from, column = to (item ids 1..n_items). EXACT (private data): release only through `fit`."""
    candidates = np.asarray(candidates)
    K = candidates.size
    slot = np.full(n_items + 1, -1)
    slot[candidates] = np.arange(K)
    total = np.zeros(K * K)
    for s in sequences:
        a, b = slot[s[:-1]], slot[s[1:]]
        keep = (a >= 0) & (b >= 0)
        if keep.any():
            cells, counts = np.unique(a[keep] * K + b[keep], return_counts=True)
            total[cells] += counts / np.linalg.norm(counts)
    return total.reshape(K, K)


def normalized_presence(sequences: list[np.ndarray], n_items: int) -> np.ndarray:
    """[n_items+1] Σ over users of 1/√(number of distinct items of the user) on each of their items: every
    user's vector has L2 norm 1 (0 without items), so adding or removing a user moves the sum by at most 1.
    EXACT (private data): release only through `fit`."""
    total = np.zeros(n_items + 1)
    for s in sequences:
        u = np.unique(s[s > 0])
        if u.size:
            total[u] += 1.0 / np.sqrt(u.size)
    return total


@dataclasses.dataclass(frozen=True)
class TransitionModel:
    """The release: `matrix` [K, K] noisy transition sums between `items` [K] (ids), `counts` [M+1] (the public
    or released item counts), and the window of `history` most recent items that scores a user."""
    items: np.ndarray
    matrix: np.ndarray
    counts: np.ndarray
    history: int
    noise_multiplier: float
    report: accounting.PrivacyReport | None

    def scores(self, histories: np.ndarray) -> np.ndarray:
        """[U, M+1] scores of every item for left-padded histories [U, L] (padding id 0 scores -inf)."""
        histories = np.asarray(histories)
        M1 = self.counts.size
        slot = np.full(M1, -1)
        slot[self.items] = np.arange(self.items.size)
        recent = slot[histories[:, -self.history:]]                        # [U, h], -1: not a candidate
        onehot = np.zeros((histories.shape[0], self.items.size + 1))
        np.add.at(onehot, (np.repeat(np.arange(histories.shape[0]), recent.shape[1]), recent.ravel()), 1.0)
        onehot = onehot[:, :-1]                                            # drop the -1 column (non-candidates)
        tiebreak = self.counts / (1.0 + np.abs(self.counts).max()) * 1e-6
        out = np.full((histories.shape[0], M1), -np.inf)
        out[:, self.items] = onehot @ self.matrix + tiebreak[self.items]
        out[:, 0] = -np.inf
        return out

    def prior_inputs(self) -> dict:
        """The release as a model's logit prior (`jdp.seqrec.models.transition_prior`): "prior_slot" [M+1] int32,
        each item's candidate row (K for any other item and for padding), and "prior_table" [K+1, M+1] float32, the
        candidates' transition sums in units of the release's noise std (1 in the NON-PRIVATE reference) spread
        over the catalogue's columns, with a zero row K. Post-processing of the release."""
        M1, K = self.counts.size, self.items.size
        slot = np.full(M1, K, np.int32)
        slot[self.items] = np.arange(K, dtype=np.int32)
        table = np.zeros((K + 1, M1), np.float32)
        table[:K, self.items] = self.matrix / (self.noise_multiplier if self.noise_multiplier > 0 else 1.0)
        return {"prior_slot": slot, "prior_table": table}

    def evaluate(self, inputs: np.ndarray, targets: np.ndarray, k: int = 10, chunk: int = 2048) -> dict:
        """NDCG@k / HIT@k over the users with a target, ranking every item (ties pessimistic, as
        `jdp.seqrec.evaluate`)."""
        inputs, targets = np.asarray(inputs), np.asarray(targets)
        keep = np.flatnonzero(targets > 0)
        if keep.size == 0:
            raise ValueError("no users with a target")
        ranks = []
        for s in range(0, keep.size, chunk):
            idx = keep[s:s + chunk]
            sc = self.scores(inputs[idx])
            own = sc[np.arange(idx.size), targets[idx]]
            # jdp.metrics.rank_of_target's rule, in float64 on the host: in float32 the tie-breaking term
            # (1e-6 of the scores' scale) would round away and turn orderings into ties
            ranks.append(np.sum(sc >= own[:, None], axis=1) - 1)
        return {**ndcg_hit_from_ranks(np.concatenate(ranks), k), "n_users": int(keep.size)}


def default_k(n_users: int, noise_std: float, n_items: int) -> int:
    """The number of candidate items from public quantities only: round(K_PER_ROOT · √(n_users / noise_std)),
    within [1, n_items] (n_users: the declared number of users; noise_std: the transition release's σ)."""
    n = check_positive(n_users, "n_users")
    k = int(round(K_PER_ROOT * math.sqrt(n / check_positive(noise_std, "noise_std"))))
    return min(max(k, 1), int(n_items))


def fit(data: D.SeqData, epsilon: float | None, delta: float, k: int | None, key: jax.Array, *, history: int = 3,
        hist_noise_multiplier: float = HIST_NOISE_MULTIPLIER, public_item_counts: np.ndarray | None = None) -> TransitionModel:
    """Releases the transition model of `data`'s training sequences at (ε, δ) in one report: the item histogram
    (unless `public_item_counts` are declared) and the [k, k] transition sums, whose noise is calibrated so
    that the composition meets (ε, δ). `k=None`: `default_k` of the declared users and that noise (public).
    `epsilon=None`: the NON-PRIVATE reference (exact counts and sums; needs k). `key` seeds both noise draws:
    keep it secret."""
    if epsilon is None:
        if k is None:
            raise ValueError("k is required for the non-private reference (default_k needs the release's noise)")
        k, history, public_item_counts = _check(data, k, history, public_item_counts)
        return release(data, k, key, None, None, history=history, public_item_counts=public_item_counts)
    given_k, history, public_item_counts = _check(data, 1 if k is None else k, history, public_item_counts)
    k = None if k is None else given_k  # refused before any work when given and out of range
    epsilon, delta = check_privacy(epsilon, delta, data.n_users, unit="user")
    report = accounting.PrivacyReport(delta, unit="user", relation=accounting.ADD_OR_REMOVE_ONE)
    for vocab_release in data.vocab_releases:
        report.add_release(vocab_release)
    for text in data.vocab_assumptions:
        report.assume(text)
    fixed = [r.composed_event() for r in report.releases]
    if public_item_counts is None:
        fixed.append(accounting.gaussian_event(check_positive(hist_noise_multiplier, "hist_noise_multiplier")))
    sigma = accounting.calibrate(lambda s: dpe.ComposedDpEvent(fixed + [accounting.gaussian_event(s)]),
                                 epsilon, delta, bracket=(0.05, 500.0))
    if k is None:
        k = default_k(data.n_users, sigma, data.n_items)
    return release(data, k, key, report, sigma, history=history, hist_noise_multiplier=hist_noise_multiplier,
                   public_item_counts=public_item_counts)


def release(data: D.SeqData, k: int, key: jax.Array, report: accounting.PrivacyReport | None,
            noise_std: float | None, *, history: int = 3, hist_noise_multiplier: float = HIST_NOISE_MULTIPLIER,
            public_item_counts: np.ndarray | None = None) -> TransitionModel:
    """The releases of `fit` at a GIVEN transition noise std (sensitivity 1), added to `report` (where the
    caller composes them with its own releases, e.g. `jdp.seqrec.train`'s item-table start): the item
    histogram at std `hist_noise_multiplier` unless `public_item_counts` are declared, then the [k, k]
    transition sums between its top k items. `report=None`: the NON-PRIVATE reference (exact counts and sums).
    Unit: a user; relation: add/remove one user (each release has L2 sensitivity 1, see the module doc)."""
    k, history, public_item_counts = _check(data, k, history, public_item_counts)
    seqs = user_sequences(data.train_input, data.train_target)
    if report is None:
        counts = (D.item_presence(data.train_input, data.train_target, data.n_items) if public_item_counts is None
                  else public_item_counts)
        items = _top(counts, k)
        return TransitionModel(items, transition_sum(seqs, items, data.n_items), counts, history, 0.0, None)
    sigma = check_positive(noise_std, "noise_std")
    k_hist, k_matrix = jax.random.split(key)
    if public_item_counts is not None:
        counts = public_item_counts
        report.assume("item counts (public_item_counts) declared public by the caller")
    else:
        # every user's item set scaled to norm 1: the popular items stand out of the noise with sensitivity 1
        # instead of the sqrt(maxlen + 1) of plain counts
        std = check_positive(hist_noise_multiplier, "hist_noise_multiplier")
        report.add_gaussian("item popularity (per-user norm 1)", sensitivity=1.0, noise_std=std)
        counts = noise.gaussian_histogram(k_hist, normalized_presence(seqs, data.n_items), std)
        counts[0] = 0.0
    items = _top(counts, k)  # post-processing of the release (or of public counts)
    report.add_gaussian("item transition sums (per-user Frobenius norm 1)", sensitivity=1.0, noise_std=sigma)
    noisy = noise.gaussian_histogram(k_matrix, transition_sum(seqs, items, data.n_items), sigma)  # float64
    return TransitionModel(items, noisy, counts, history, float(sigma), report)


class ItemEmbedding(NamedTuple):
    """rows [K, d] and signs [d] (±1, 0 for an unused column) with rows · diag(signs) · rowsᵀ ∝ the best rank-d
    approximation of the symmetrised release."""
    rows: np.ndarray
    signs: np.ndarray


def item_embedding(model: TransitionModel, d: int) -> ItemEmbedding:
    """Rows for `model.items` whose signed inner products approximate the symmetrised released transitions
    (A + Aᵀ)/2: its eigenvectors of the d largest |eigenvalues|, each scaled by the square root of its |eigenvalue|
    and signed by its sign (the negative part matters as much as the positive one: it says which items do NOT
    follow each other), then all rows by one factor to an RMS norm of 1 (a random embedding's). Post-processing of
    the release."""
    if int(d) != d or d < 1:
        raise ValueError(f"d must be a positive integer, got {d}")
    sym = (model.matrix + model.matrix.T) / 2.0
    values, vectors = np.linalg.eigh(sym)
    top = np.argsort(-np.abs(values), kind="stable")[:int(d)]
    kept = np.where(np.abs(values[top]) > 1e-12 * np.abs(values).max(), values[top], 0.0)  # rounding noise is no signal
    rows = np.zeros((sym.shape[0], int(d)))
    signs = np.zeros(int(d))
    rows[:, :top.size] = vectors[:, top] * np.sqrt(np.abs(kept))
    signs[:top.size] = np.sign(kept)
    rms = np.sqrt(np.mean(np.sum(rows ** 2, axis=1)))
    return ItemEmbedding(rows / rms if rms > 0 else rows, signs)


def _check(data: D.SeqData, k, history, public_item_counts) -> tuple[int, int, np.ndarray | None]:
    if int(k) != k or k < 1 or k > data.n_items:
        raise ValueError(f"k must be an integer in [1, n_items={data.n_items}], got {k}")
    if int(history) != history or history < 1:
        raise ValueError(f"history must be a positive integer, got {history}")
    if public_item_counts is not None:
        public_item_counts = np.asarray(public_item_counts, np.float64)
        if public_item_counts.shape != (data.n_items + 1,) or not np.isfinite(public_item_counts).all():
            raise ValueError(f"public_item_counts must be a finite array of shape ({data.n_items + 1},)")
    return int(k), int(history), public_item_counts


def _top(counts: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest counts (padding id 0 excluded; ties by smaller id)."""
    c = np.asarray(counts, np.float64).copy()
    c[0] = -np.inf
    return np.sort(np.argsort(-c, kind="stable")[:k])


__all__ = ["HIST_NOISE_MULTIPLIER", "K_PER_ROOT", "ItemEmbedding", "TransitionModel", "default_k", "fit", "item_embedding",
           "release", "transition_sum", "user_sequences"]
