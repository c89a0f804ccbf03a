"""Sparse user-item interactions (COO) with validation and CSR views.

Data plumbing, not a private routine: nothing here is released. Counts computed here
(`item_counts`, `user_counts`, CSR row pointers) are EXACT; use them only in non-private code
(non-private baselines, evaluation, bucketing test metrics) or in private code whose caller
explicitly declares them public. Private algorithms must estimate counts privately.
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

    Invalid input raises ValueError naming the field. Arrays are stored as read-only views.
    Duplicate (user, item) pairs are allowed here; readers and generators in jdp.data produce none.
    Not private: see the module docstring (exact counts are for non-private code / evaluation only).
    """

    user: np.ndarray
    item: np.ndarray
    rating: np.ndarray
    n_users: int
    n_items: int
    timestamp: np.ndarray | None = None

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
        object.__setattr__(self, "n_users", n_users)
        object.__setattr__(self, "n_items", n_items)
        object.__setattr__(self, "user", user)
        object.__setattr__(self, "item", item)
        object.__setattr__(self, "rating", _readonly(rating))
        object.__setattr__(self, "timestamp", timestamp)

    @property
    def nnz(self) -> int:
        """Number of observations."""
        return int(self.user.shape[0])

    def __len__(self) -> int:
        return self.nnz

    def __repr__(self) -> str:
        ts = "yes" if self.timestamp is not None else "no"
        return f"Interactions(n_users={self.n_users}, n_items={self.n_items}, nnz={self.nnz}, timestamp={ts})"

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
        return Interactions(self.user[sel], self.item[sel], self.rating[sel], self.n_users, self.n_items, ts)

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

    def binarize(self, threshold: float = 4.0) -> "Interactions":
        """Implicit feedback: keep observations with rating >= threshold, each with rating 1."""
        if not np.isfinite(threshold):
            raise ValueError(f"threshold must be finite, got {threshold}")
        out = self.subset(self.rating >= threshold)
        return dataclasses.replace(out, rating=np.ones(out.nnz, dtype=np.float32))


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
    has_ts = [p.timestamp is not None for p in parts]
    ts = np.concatenate([p.timestamp for p in parts]) if all(has_ts) else None
    return Interactions(np.concatenate([p.user for p in parts]), np.concatenate([p.item for p in parts]),
                        np.concatenate([p.rating for p in parts]), n_users, n_items, ts)
