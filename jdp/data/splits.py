"""Train/valid/test splits: random over ratings (ML10M protocol), a per-row keyed split that is local to each
user (`split_ratings_by_pair_hash`, for splitting private data) and held-out-user fold-in (ML20M protocol).

Data plumbing, not a private routine: nothing is released, and the splits use exact counts
(e.g. the `min_items` user filter). This matches the evaluation protocols of the papers; the
split itself is treated as public preprocessing by the experiments that use it.

Sizes: `split_ratings` keeps the declared n_users / n_items of its input (public sizes for the
private routines). `fold_in_split` re-indexes users and (with `restrict_items=True`) items from
exact counts of the data, so its sizes are DATA-DEPENDENT: before training a released model on its
"train" part, declare public sizes (`restrict_items=False` keeps the item catalogue; replace the
user count by a public bound, e.g. `dataclasses.replace(out["train"], n_users=bound)`).
`split_ratings` permutes all rows together, so which rows of one user land in a part depends on every
other user's rows (adding or removing one user shifts the whole assignment): use it only on data whose
split is public. `split_ratings_by_pair_hash` assigns each row from a keyed hash of its (user, item) pair
alone, so adding or removing a user (with all their rows) leaves every other user's parts unchanged: the
split is a per-user preprocessing step and a neighbouring pair of datasets stays a neighbouring pair of
(train, valid) splits.
Duplicate (user, item) rows are split like any other row (copies may land in train and test);
merge them first (`Interactions.merge_duplicates`) when that matters.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from jdp.data.interactions import Interactions


def _check_seed(seed) -> int:
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)


def split_ratings(data: Interactions, fractions: Sequence[float] = (0.8, 0.1, 0.1),
                  seed: int = 0) -> tuple[Interactions, ...]:
    """Random split of the observations into len(fractions) parts (2 or 3), e.g. 80/10/10 or 80/20.

    Part k gets floor(fractions[k]·nnz) observations (the last part takes the remainder); parts are
    disjoint, cover every observation, keep the original order within a part, and share
    n_users/n_items with `data`. Deterministic given `seed`.
    """
    if not isinstance(data, Interactions):
        raise ValueError(f"data must be Interactions, got {type(data).__name__}")
    if data.nnz == 0:
        raise ValueError("data must be non-empty")
    fr = np.asarray(fractions, dtype=np.float64)
    if fr.ndim != 1 or fr.size not in (2, 3):
        raise ValueError(f"fractions must have 2 or 3 entries, got {fractions!r}")
    if not np.isfinite(fr).all() or (fr <= 0).any() or abs(fr.sum() - 1.0) > 1e-6:
        raise ValueError(f"fractions must be positive and sum to 1, got {fractions!r}")
    rng = np.random.default_rng(_check_seed(seed))
    perm = rng.permutation(data.nnz)
    sizes = np.floor(fr[:-1] * data.nnz).astype(np.int64)
    bounds = np.concatenate([[0], np.cumsum(sizes), [data.nnz]])
    # Sorting the indices of each part keeps the original order (e.g. by user or by time) inside it.
    return tuple(data.subset(np.sort(perm[bounds[k]:bounds[k + 1]])) for k in range(fr.size))


# splitmix64's finaliser (Steele, Lea & Flood 2014): a bijection of 64-bit words whose output bits each
# depend on every input bit; with the golden-ratio increment it hashes a chain of integers (seed, user, item).
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX1  # uint64 arrays wrap modulo 2^64, as the hash intends
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX2
    return x ^ (x >> np.uint64(31))


def pair_hash(seed: int, user, item) -> np.ndarray:
    """uint64 keyed hash of each (user, item) pair: a function of `seed` and that pair only (no row order,
    no other rows). `seed` in [0, 2^64)."""
    seed = _check_seed(seed)
    if seed >= 2**64:
        raise ValueError(f"seed must be below 2**64, got {seed}")
    u = np.asarray(user).astype(np.uint64)
    i = np.asarray(item).astype(np.uint64)
    h = _mix64(np.full(u.shape, seed, dtype=np.uint64) + _GOLDEN)
    h = _mix64((h + _GOLDEN) ^ u)
    return _mix64((h + _GOLDEN) ^ i)


def split_ratings_by_pair_hash(data: Interactions, valid_fraction: float = 0.1,
                               seed: int = 0) -> tuple[Interactions, Interactions]:
    """(train, valid) split in which each row's part depends on its own (user, item) pair and `seed` only.

    A row goes to valid iff the top 53 bits of `pair_hash(seed, user, item)`, read as a fraction of 2^53, are
    below `valid_fraction`: each row independently with probability `valid_fraction` (up to 2^-53) over
    the seed, about `valid_fraction` of the rows overall. Adding or removing one user (and all their
    rows) changes no other user's rows in either part, which is what a user-level private routine that
    reads both parts (e.g. `jdp.altmin.tune_private`) needs: neighbouring inputs give neighbouring
    (train, valid) pairs. The seed may be public (the split is not a release; what is private is the
    data the parts hold). Every row lands in exactly one part (nothing is dropped; a user may end up with
    rows in one part only); rows keep their original order inside a part and both parts keep
    n_users/n_items. Duplicate (user, item) rows land in the same part.
    """
    if not isinstance(data, Interactions):
        raise ValueError(f"data must be Interactions, got {type(data).__name__}")
    if data.nnz == 0:
        raise ValueError("data must be non-empty")
    fraction = float(valid_fraction) if isinstance(valid_fraction, (int, float, np.floating)) and not isinstance(
        valid_fraction, (bool, np.bool_)) else math.nan
    if not (0.0 < fraction < 1.0):
        raise ValueError(f"valid_fraction must lie in (0, 1), got {valid_fraction!r}")
    threshold = np.uint64(round(fraction * 2.0**53))
    in_valid = (pair_hash(seed, data.user, data.item) >> np.uint64(11)) < threshold
    return data.subset(~in_valid), data.subset(in_valid)


def _remap_users(part: Interactions, user_ids: np.ndarray, item_map: np.ndarray, n_items: int) -> Interactions:
    """Re-indexes `part` (already restricted to users in sorted `user_ids`) to users 0..len-1, items via map."""
    user = np.searchsorted(user_ids, part.user).astype(np.int32)
    return Interactions(user, item_map[part.item], part.rating, int(user_ids.size), n_items, part.timestamp,
                        part.rating_range)


def fold_in_split(data: Interactions, n_heldout_users: int, min_items: int = 5, history_frac: float = 0.8,
                  seed: int = 0, restrict_items: bool = True) -> dict:
    """Held-out-user split of Liang et al. (2018), the ML20M top-k protocol (callers binarize first).

    1. keep users with >= `min_items` observations (exact counts);
    2. a seeded permutation of those users: the last 2·n_heldout_users are held out, half for
       validation, half for test; the rest are training users (all their observations -> "train");
    3. `restrict_items=True` (the protocol): items are re-indexed to those seen in "train" and
       held-out observations of other items are DROPPED; `restrict_items=False` keeps the
       original item ids and drops nothing;
    4. each held-out user with >= min_items remaining observations gets floor((1-history_frac)·n)
       random observations as "*_target" and the rest as "*_history"; users with fewer go entirely to
       "*_history" (as in the protocol), so some held-out users have no targets.

    Returns a dict: "train", "valid_history", "valid_target", "test_history", "test_target"
    (Interactions; the three user groups are each re-indexed to 0..k-1 in increasing original id,
    history and target of a group share that user index and all parts share one item index), plus
    "train_user_ids", "valid_user_ids", "test_user_ids" (int64, original user id of each new index)
    and "item_ids" (int64, original item id of each new item index).
    """
    if not isinstance(data, Interactions):
        raise ValueError(f"data must be Interactions, got {type(data).__name__}")
    if data.nnz == 0:
        raise ValueError("data must be non-empty")
    for name, v in (("n_heldout_users", n_heldout_users), ("min_items", min_items)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if not (0.0 < history_frac < 1.0):
        raise ValueError(f"history_frac must be in (0, 1), got {history_frac!r}")
    rng = np.random.default_rng(_check_seed(seed))

    counts = data.user_counts()
    eligible = np.flatnonzero(counts >= min_items)
    if eligible.size <= 2 * n_heldout_users:
        raise ValueError(f"n_heldout_users={n_heldout_users} too large: only {eligible.size} users have "
                         f">= min_items={min_items} observations and at least one training user is needed")
    perm = rng.permutation(eligible)
    n_train = eligible.size - 2 * n_heldout_users
    groups = {"train": np.sort(perm[:n_train]),
              "valid": np.sort(perm[n_train:n_train + n_heldout_users]),
              "test": np.sort(perm[n_train + n_heldout_users:])}
    group_of_user = np.full(data.n_users, -1, dtype=np.int8)  # -1: filtered out (too few items)
    for g, name in enumerate(("train", "valid", "test")):
        group_of_user[groups[name]] = g
    group = group_of_user[data.user]

    train = data.subset(group == 0)
    if restrict_items:
        seen = np.bincount(train.item, minlength=data.n_items) > 0
        item_ids = np.flatnonzero(seen)
        item_map = np.cumsum(seen, dtype=np.int64) - 1  # valid only where seen
        keep_item = seen[data.item]
    else:
        item_ids = np.arange(data.n_items)
        item_map = item_ids
        keep_item = np.ones(data.nnz, dtype=np.bool_)
    n_items = int(item_ids.size)

    out: dict = {"train": _remap_users(train, groups["train"], item_map, n_items)}
    # One random key per observation, ranked within each user: the smallest n_target keys are targets.
    # Vectorised over all held-out users (no per-user loop).
    keys = rng.random(data.nnz)
    for g, name in ((1, "valid"), (2, "test")):
        part = data.subset((group == g) & keep_item)
        pk = keys[(group == g) & keep_item]
        n_u = np.bincount(part.user, minlength=data.n_users)
        n_target = np.where(n_u >= min_items, np.floor((1.0 - history_frac) * n_u + 1e-9), 0).astype(np.int64)
        order = np.lexsort((pk, part.user))  # by user, then random key
        starts = np.concatenate([[0], np.cumsum(n_u)])[:-1]
        rank = np.empty(part.nnz, dtype=np.int64)
        rank[order] = np.arange(part.nnz) - starts[part.user[order]]
        is_target = rank < n_target[part.user]
        out[f"{name}_history"] = _remap_users(part.subset(~is_target), groups[name], item_map, n_items)
        out[f"{name}_target"] = _remap_users(part.subset(is_target), groups[name], item_map, n_items)
    out["train_user_ids"] = groups["train"].astype(np.int64)
    out["valid_user_ids"] = groups["valid"].astype(np.int64)
    out["test_user_ids"] = groups["test"].astype(np.int64)
    out["item_ids"] = item_ids.astype(np.int64)
    return out
