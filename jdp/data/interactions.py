"""Sparse user-item interactions (COO) with validation and CSR views.

Data plumbing, not a private routine: nothing here is released. Counts computed here
(`item_counts`, `user_counts`, CSR row pointers) are EXACT; use them only in non-private code
(non-private baselines, evaluation, bucketing test metrics) or in private code whose caller
explicitly declares them public. Private algorithms must estimate counts privately.

This module is also the one place that validates the "one observation per (user, item)" assumption
of the user-level private routines (`check_unique_pairs`) and that merges duplicates on request
(`Interactions.merge_duplicates`).
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

import numpy as np

_INT32_MAX = np.iinfo(np.int32).max


def _readonly(arr: np.ndarray) -> np.ndarray:
    # A read-only view: the frozen dataclass cannot be mutated through its arrays, and the
    # caller's own array keeps its flags.
    view = arr.view()
    view.flags.writeable = False
    return view


def _check_size(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < 0 or value > _INT32_MAX:
        raise ValueError(f"{name} must be in [0, {_INT32_MAX}], got {value}")
    return value


def _check_ids(name: str, ids, upper: int, upper_name: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must have an integer dtype, got {arr.dtype}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= upper:
            raise ValueError(f"{name} ids must lie in [0, {upper_name}={upper}), got range [{lo}, {hi}]")
    return _readonly(arr.astype(np.int32, copy=False))


@dataclasses.dataclass(frozen=True, eq=False)
class Interactions:
    """Explicit or implicit feedback as COO triples, validated on construction.

    Fields (nnz = number of observations):
      user:      int32 [nnz], 0 <= user < n_users
      item:      int32 [nnz], 0 <= item < n_items
      rating:    float32 [nnz], finite (1.0 for implicit feedback)
      n_users, n_items: sizes of the id spaces (ids need not all occur)
      timestamp: int64 [nnz] or None
      rating_range: (lo, hi), the PUBLIC rating scale the ratings were given on, or None (undeclared).
                 Declared by whoever builds the object (`load_movielens` sets it from the published
                 release's format); every rating must lie in it. `jdp.altmin` uses it as its rating
                 scale unless the config declares one (`AltMinConfig.rating_range`).

    Invalid input raises ValueError naming the field. Arrays are stored as read-only views.

    Sizes: `n_users` and `n_items` are DECLARED by whoever builds the object; they are not computed
    from the rows. The private routines (`jdp.altmin.fit`, `jdp.multitask`) treat them as PUBLIC: n_items
    is the item catalogue (the rows of the released item matrix), n_users a public bound on the number
    of users (the user id space). Neither may be derived from the private rows when the result is
    released: adding or removing one user must not change them. Declare them from public knowledge
    (e.g. the catalogue, the size of the id space, a published dataset size); `load_movielens` takes
    them as arguments (by default it derives them from the file, which is fine for reproducing
    published experiments on a fixed dataset only).

    Duplicate (user, item) pairs are allowed HERE (user-supplied files may contain them; the
    MovieLens files and the generators in jdp.data have none), but the user-level private routines
    assume at most one observation per pair and reject duplicates with a ValueError
    (`check_unique_pairs`). `merge_duplicates()` is the explicit opt-in that replaces them by their
    mean rating. Not private: see the module docstring (exact counts are for non-private code only).
    """

    user: np.ndarray
    item: np.ndarray
    rating: np.ndarray
    n_users: int
    n_items: int
    timestamp: np.ndarray | None = None
    rating_range: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        n_users = _check_size("n_users", self.n_users)
        n_items = _check_size("n_items", self.n_items)
        user = _check_ids("user", self.user, n_users, "n_users")
        item = _check_ids("item", self.item, n_items, "n_items")
        rating = np.asarray(self.rating)
        if rating.ndim != 1:
            raise ValueError(f"rating must be 1-D, got shape {rating.shape}")
        if rating.size and not (np.issubdtype(rating.dtype, np.floating) or np.issubdtype(rating.dtype, np.integer)
                                or rating.dtype == np.bool_):
            raise ValueError(f"rating must be numeric, got dtype {rating.dtype}")
        with np.errstate(over="ignore"):  # overflow to inf is reported below as non-finite
            rating = rating.astype(np.float32, copy=False)
        if rating.size and not np.isfinite(rating).all():
            bad = int(np.size(rating) - np.isfinite(rating).sum())
            raise ValueError(f"rating must be finite (after float32 cast); found {bad} NaN/inf values")
        if not (user.shape[0] == item.shape[0] == rating.shape[0]):
            raise ValueError(f"user, item and rating must have equal lengths, got "
                             f"{user.shape[0]}, {item.shape[0]}, {rating.shape[0]}")
        timestamp = self.timestamp
        if timestamp is not None:
            timestamp = np.asarray(timestamp)
            if timestamp.ndim != 1 or timestamp.shape[0] != user.shape[0]:
                raise ValueError(f"timestamp must be 1-D with length nnz={user.shape[0]}, got shape {timestamp.shape}")
            if timestamp.size and not np.issubdtype(timestamp.dtype, np.integer):
                raise ValueError(f"timestamp must have an integer dtype, got {timestamp.dtype}")
            timestamp = _readonly(timestamp.astype(np.int64, copy=False))
        scale = _check_rating_range(self.rating_range, rating)
        object.__setattr__(self, "n_users", n_users)
        object.__setattr__(self, "n_items", n_items)
        object.__setattr__(self, "user", user)
        object.__setattr__(self, "item", item)
        object.__setattr__(self, "rating", _readonly(rating))
        object.__setattr__(self, "timestamp", timestamp)
        object.__setattr__(self, "rating_range", scale)

    @property
    def nnz(self) -> int:
        """Number of observations."""
        return int(self.user.shape[0])

    def __len__(self) -> int:
        return self.nnz

    def __repr__(self) -> str:
        ts = "yes" if self.timestamp is not None else "no"
        scale = "" if self.rating_range is None else f", rating_range={self.rating_range}"
        return f"Interactions(n_users={self.n_users}, n_items={self.n_items}, nnz={self.nnz}, timestamp={ts}{scale})"

    def subset(self, mask_or_index) -> "Interactions":
        """Observations selected by a bool mask [nnz] or an integer index array; same n_users/n_items."""
        sel = np.asarray(mask_or_index)
        if sel.dtype == np.bool_:
            if sel.shape != (self.nnz,):
                raise ValueError(f"mask_or_index: bool mask must have shape ({self.nnz},), got {sel.shape}")
        elif np.issubdtype(sel.dtype, np.integer) or sel.size == 0:
            sel = sel.astype(np.int64, copy=False).reshape(-1)
            if sel.size and (sel.min() < -self.nnz or sel.max() >= self.nnz):
                raise ValueError(f"mask_or_index: index out of range for nnz={self.nnz}")
        else:
            raise ValueError(f"mask_or_index must be a bool mask or integer indices, got dtype {sel.dtype}")
        ts = None if self.timestamp is None else self.timestamp[sel]
        return Interactions(self.user[sel], self.item[sel], self.rating[sel], self.n_users, self.n_items, ts,
                            self.rating_range)

    def item_counts(self) -> np.ndarray:
        """EXACT observations per item, int64 [n_items]. Non-private: evaluation / baselines only."""
        return np.bincount(self.item, minlength=self.n_items).astype(np.int64)

    def user_counts(self) -> np.ndarray:
        """EXACT observations per user, int64 [n_users]. Non-private: evaluation / baselines only."""
        return np.bincount(self.user, minlength=self.n_users).astype(np.int64)

    def to_csr(self, by: Literal["user", "item"] = "user") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """CSR view grouped by `by`.

        Returns (indptr int64 [n_rows+1], indices int32 [nnz] (the other id), values float32 [nnz],
        order int64 [nnz]) where `order` is the permutation with indices == other[order]. Rows are
        sorted; within a row the original observation order is kept (stable sort).
        """
        if by == "user":
            key, other, n_rows = self.user, self.item, self.n_users
        elif by == "item":
            key, other, n_rows = self.item, self.user, self.n_items
        else:
            raise ValueError(f"by must be 'user' or 'item', got {by!r}")
        order = np.argsort(key, kind="stable").astype(np.int64, copy=False)
        indptr = np.zeros(n_rows + 1, dtype=np.int64)
        np.cumsum(np.bincount(key, minlength=n_rows), out=indptr[1:])
        return indptr, other[order], self.rating[order], order

    def merge_duplicates(self) -> "Interactions":
        """One observation per (user, item): duplicates are replaced by their MEAN rating (and the latest
        timestamp), placed at the position of the pair's first occurrence; returns `self` when there
        are none. Sizes are unchanged.

        Each merged value depends only on one user's own rows, so merging before a user-level private
        routine costs no privacy: it is a per-user transformation of the user's own data.
        """
        key, span = _pair_keys(self.user, self.item)
        if _first_duplicate(key) is None:
            return self
        order = np.argsort(key)
        sk = key[order]
        start = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
        group_size = np.diff(np.r_[start, sk.size])
        mean = np.add.reduceat(self.rating[order].astype(np.float64), start) / group_size
        group = np.empty(key.size, np.int64)
        group[order] = np.repeat(np.arange(start.size), group_size)  # pair index of every row
        is_first = np.zeros(key.size, np.bool_)
        is_first[np.minimum.reduceat(order, start)] = True  # each pair's first row (O(n), no 2nd sort)
        keep = group[np.flatnonzero(is_first)]
        ts = None
        if self.timestamp is not None:
            ts = np.maximum.reduceat(self.timestamp[order], start)[keep]
        pairs = sk[start][keep]
        return Interactions((pairs // span).astype(np.int32), (pairs % span).astype(np.int32),
                            mean[keep].astype(np.float32), self.n_users, self.n_items, ts, self.rating_range)

    def binarize(self, threshold: float = 4.0) -> "Interactions":
        """Implicit feedback: keep observations with rating >= threshold, each with rating 1 (no rating scale)."""
        if not np.isfinite(threshold):
            raise ValueError(f"threshold must be finite, got {threshold}")
        out = self.subset(self.rating >= threshold)
        return dataclasses.replace(out, rating=np.ones(out.nnz, dtype=np.float32), rating_range=None)


def _check_rating_range(rating_range, rating: np.ndarray) -> tuple[float, float] | None:
    """The declared scale as a (lo, hi) tuple of floats; ValueError if it is malformed or a rating lies outside."""
    if rating_range is None:
        return None
    try:
        lo, hi = (float(v) for v in rating_range)
    except (TypeError, ValueError):
        raise ValueError(f"rating_range must be None or a pair (lo, hi) of numbers, got {rating_range!r}") from None
    if not (np.isfinite(lo) and np.isfinite(hi) and lo < hi):
        raise ValueError(f"rating_range must be finite with lo < hi, got {rating_range!r}")
    outside = (rating < lo) | (rating > hi)
    if outside.any():
        raise ValueError(f"rating_range: {int(outside.sum())} ratings lie outside the declared scale [{lo:g}, {hi:g}], "
                         f"e.g. {float(rating[np.argmax(outside)]):g}; declare the scale the ratings were given on")
    return lo, hi


def _pair_keys(user, item) -> tuple[np.ndarray, int]:
    """One int64 key per row, equal iff (user, item) is equal; ids are non-negative int32-range."""
    user = np.asarray(user).astype(np.int64, copy=False).reshape(-1)
    item = np.asarray(item).astype(np.int64, copy=False).reshape(-1)
    span = int(item.max()) + 1 if item.size else 1
    return user * span + item, span  # < 2^62 for int32 ids: no overflow


def _first_duplicate(key: np.ndarray) -> tuple[np.ndarray, int] | None:
    """None if all keys are distinct, else (sorted keys, index in it of the first repeated key)."""
    if key.size < 2 or np.all(key[1:] > key[:-1]):  # O(n) fast path: rows already sorted by (user, item)
        return None
    sk = np.sort(key)
    rep = np.flatnonzero(sk[1:] == sk[:-1])
    return None if rep.size == 0 else (sk, int(rep[0]))


def duplicate_pairs(user, item) -> tuple[int, tuple[int, int, int] | None]:
    """(number of duplicate rows, (user, item, multiplicity) of one duplicated pair, or None).

    A pair seen c times counts c − 1 duplicate rows. Vectorised: one int64 sort (≈0.4 s for 10M rows),
    O(n) when the rows are already sorted by (user, item).
    """
    user, item = np.asarray(user), np.asarray(item)
    if user.shape != item.shape or user.ndim != 1:
        raise ValueError(f"user and item must be 1-D of equal length, got shapes {user.shape} and {item.shape}")
    if user.size and (user.min() < 0 or item.min() < 0):
        raise ValueError("user and item ids must be non-negative")
    key, span = _pair_keys(user, item)
    found = _first_duplicate(key)
    if found is None:
        return 0, None
    sk, at = found
    n_dup = int(np.count_nonzero(sk[1:] == sk[:-1]))
    k = sk[at]
    mult = int(np.searchsorted(sk, k, side="right") - np.searchsorted(sk, k, side="left"))
    return n_dup, (int(k // span), int(k % span), mult)


def check_unique_pairs(user, item, names: tuple[str, str] = ("user", "item"), where: str = "",
                       remedy: str = "Interactions.merge_duplicates(): mean rating per pair") -> None:
    """Raises ValueError if some (user, item) pair occurs more than once.

    The single validation point of jdp's user-level private routines, whose sensitivities assume at
    most one observation per (user, item): a user repeating a row c times would otherwise contribute
    up to c times (counts) or √c times (Gram / gradient norms) the accounted sensitivity. The message
    gives the number of duplicate rows and one duplicated pair; `Interactions.merge_duplicates()`
    (mean rating per pair) is the explicit opt-in remedy.
    """
    n_dup, example = duplicate_pairs(user, item)
    if n_dup:
        u, i, mult = example
        at = f"{where}: " if where else ""
        raise ValueError(f"{at}{n_dup} duplicate ({names[0]}, {names[1]}) rows, e.g. {names[0]} {u}, {names[1]} {i} "
                         f"occurs {mult} times; the user-level sensitivity assumes one observation per pair. "
                         f"Merge them first ({remedy}) or remove them")


def concat(parts: Sequence[Interactions]) -> Interactions:
    """Concatenates observations of Interactions sharing n_users and n_items (e.g. train + valid)."""
    parts = list(parts)
    if not parts:
        raise ValueError("parts must be non-empty")
    n_users, n_items = parts[0].n_users, parts[0].n_items
    for p in parts:
        if not isinstance(p, Interactions):
            raise ValueError(f"parts must be Interactions, got {type(p).__name__}")
        if (p.n_users, p.n_items) != (n_users, n_items):
            raise ValueError(f"parts must share n_users/n_items, got ({p.n_users}, {p.n_items}) "
                             f"vs ({n_users}, {n_items})")
    scales = {p.rating_range for p in parts}
    if len(scales) > 1:
        raise ValueError(f"parts must share rating_range, got {sorted(scales, key=str)}")
    has_ts = [p.timestamp is not None for p in parts]
    ts = np.concatenate([p.timestamp for p in parts]) if all(has_ts) else None
    return Interactions(np.concatenate([p.user for p in parts]), np.concatenate([p.item for p in parts]),
                        np.concatenate([p.rating for p in parts]), n_users, n_items, ts, scales.pop())
