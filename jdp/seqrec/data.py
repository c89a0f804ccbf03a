"""Sequential-recommendation data: SASRec-format and rating-file readers, leave-last-out split, padding.

Preprocessing follows SASRec (Kang & McAuley 2018): one chronological item sequence per user, items
re-indexed 1..M (0 is padding), leave-last-out split (train = all but the last two items, valid = the
second last, test = the last; users with < 3 items keep everything in train and are not evaluated),
left-padding to `maxlen` keeping the most recent items. One sequence per user, so DP training over
these sequences is user-level.

Readers:
- `read_sasrec(path)`: lines "user item" already in time order (e.g. the Amazon Games `Video.txt`).
- `read_ratings(path)`: MovieLens rating files, `u.data` (tab separated: user item rating timestamp)
  or ML-1M `ratings.dat` (`user::item::rating::timestamp`); every rating is an implicit interaction,
  ordered by timestamp (ties keep file order). Optional SASRec-style one-pass filter on raw counts.
"""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

AMAZON_MAXLEN = 50
MOVIELENS_MAXLEN = 200


@dataclasses.dataclass(frozen=True)
class SeqData:
    """Padded sequences, all int32 with 0 = padding; items are 1..n_items.

    train_input/train_target: [U, L] next-item pairs at every position (target 0 = no loss);
    valid_input/test_input: [U, L] histories; valid_target/test_target: [U] (0 = user not evaluated).
    """
    n_items: int
    maxlen: int
    train_input: np.ndarray
    train_target: np.ndarray
    valid_input: np.ndarray
    valid_target: np.ndarray
    test_input: np.ndarray
    test_target: np.ndarray

    @property
    def n_users(self) -> int:
        return int(self.train_input.shape[0])


def _read_ints(path: str | pathlib.Path, n_cols: int) -> np.ndarray:
    path = pathlib.Path(path)
    if not path.exists():
        raise ValueError(f"data_path does not exist: {path}")
    text = path.read_text().replace("::", " ")
    vals = np.array(text.split(), dtype=np.int64)
    if vals.size == 0:
        raise ValueError(f"data_path is empty: {path}")
    if vals.size % n_cols:
        raise ValueError(f"data_path {path}: expected {n_cols} columns per line")
    return vals.reshape(-1, n_cols)


def _group(users: np.ndarray, items: np.ndarray) -> list[np.ndarray]:
    """Per-user item arrays, users in order of first appearance, items keep their (sorted) order."""
    order = np.argsort(users, kind="stable")
    u, it = users[order], items[order]
    starts = np.flatnonzero(np.r_[True, u[1:] != u[:-1]])
    seqs = np.split(it, starts[1:])
    first = np.unique(users, return_index=True)[1]  # first appearance per (sorted) user id
    return [seqs[i] for i in np.argsort(first, kind="stable")]


def _reindex(seqs: list[np.ndarray]) -> tuple[list[np.ndarray], int]:
    """Re-indexes items 1..M in order of first appearance."""
    flat = np.concatenate(seqs)
    uniq, first = np.unique(flat, return_index=True)
    rank = np.empty(uniq.size, np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(1, uniq.size + 1)
    out = [rank[np.searchsorted(uniq, s)].astype(np.int32) for s in seqs]
    return out, int(uniq.size)


def read_sasrec(path: str | pathlib.Path) -> tuple[list[np.ndarray], int]:
    """Reads "user item" lines in time order -> (per-user item sequences, n_items); ids re-indexed 1..M."""
    arr = _read_ints(path, 2)
    if (arr < 0).any():
        raise ValueError("data_path contains negative ids")
    return _reindex(_group(arr[:, 0], arr[:, 1]))


def read_ratings(path: str | pathlib.Path, min_user_count: int = 5,
                 min_item_count: int = 5) -> tuple[list[np.ndarray], int]:
    """Reads a MovieLens rating file (u.data or ratings.dat) -> chronological sequences, n_items.

    Drops ratings of users / items with fewer than the given raw counts (one pass, as SASRec did),
    sorts each user's items by timestamp (stable), re-indexes items 1..M.
    """
    arr = _read_ints(path, 4)
    users, items, ts = arr[:, 0], arr[:, 1], arr[:, 3]
    uc = np.unique(users, return_counts=True)
    ic = np.unique(items, return_counts=True)
    keep = (np.isin(users, uc[0][uc[1] >= min_user_count]) & np.isin(items, ic[0][ic[1] >= min_item_count]))
    if not keep.any():
        raise ValueError("no interactions left after filtering (min_user_count / min_item_count)")
    users, items, ts = users[keep], items[keep], ts[keep]
    order = np.lexsort((ts, users))  # by user id, then timestamp; lexsort is stable (ties: file order)
    users, items = users[order], items[order]
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    seqs = np.split(items, starts[1:])
    # Users in order of first appearance in the file.
    uniq, first = np.unique(arr[keep][:, 0], return_index=True)
    seqs = [seqs[i] for i in np.argsort(first, kind="stable")]
    return _reindex(seqs)


def pad_left(seqs: list[np.ndarray], maxlen: int) -> np.ndarray:
    """[U, maxlen] int32: the last `maxlen` items of each sequence, left-padded with 0."""
    if maxlen < 1:
        raise ValueError(f"maxlen must be >= 1, got {maxlen}")
    out = np.zeros((len(seqs), maxlen), np.int32)
    for u, s in enumerate(seqs):  # one-off preprocessing, not a hot path
        s = np.asarray(s)[-maxlen:]
        if s.size:
            out[u, maxlen - s.size:] = s
    return out


def leave_last_out(seqs: list[np.ndarray], n_items: int, maxlen: int) -> SeqData:
    """SASRec split + padding. Valid input = train items; test input = train items + valid item."""
    if not seqs:
        raise ValueError("seqs must be non-empty")
    for s in seqs:
        if s.size and (s.min() < 1 or s.max() > n_items):
            raise ValueError(f"item ids must be in [1, {n_items}]")
    train, valid_t, test_t, test_hist = [], [], [], []
    for s in seqs:
        if s.size < 3:
            train.append(s)
            valid_t.append(0)
            test_t.append(0)
            test_hist.append(s)
        else:
            train.append(s[:-2])
            valid_t.append(int(s[-2]))
            test_t.append(int(s[-1]))
            test_hist.append(s[:-1])
    return SeqData(
        n_items=int(n_items), maxlen=int(maxlen),
        train_input=pad_left([t[:-1] for t in train], maxlen),
        train_target=pad_left([t[1:] for t in train], maxlen),
        valid_input=pad_left(train, maxlen), valid_target=np.asarray(valid_t, np.int32),
        test_input=pad_left(test_hist, maxlen), test_target=np.asarray(test_t, np.int32),
    )


def load(name: str, path: str | pathlib.Path | None = None, maxlen: int | None = None,
         datasets_dir: str | pathlib.Path | None = None) -> SeqData:
    """Loads 'amazon-games' (SASRec file), 'ml-100k' (u.data) or 'ml-1m' (ratings.dat) and splits it.

    `path` overrides the file; otherwise `datasets_dir/<name>/<file>` is used. maxlen defaults to 50
    for Amazon and 200 for MovieLens.
    """
    files = {"amazon-games": "Video.txt", "ml-100k": "u.data", "ml-1m": "ratings.dat"}
    if name not in files:
        raise ValueError(f"data must be one of {sorted(files)}, got {name!r}")
    if path is None:
        if datasets_dir is None:
            raise ValueError("give data_path (or datasets_dir)")
        path = pathlib.Path(datasets_dir) / name / files[name]
    if name == "amazon-games":
        seqs, n_items = read_sasrec(path)
        maxlen = AMAZON_MAXLEN if maxlen is None else maxlen
    else:
        seqs, n_items = read_ratings(path)
        maxlen = MOVIELENS_MAXLEN if maxlen is None else maxlen
    return leave_last_out(seqs, n_items, maxlen)


def item_presence(inputs: np.ndarray, targets: np.ndarray, n_items: int) -> np.ndarray:
    """[n_items+1] number of users whose training sequence (inputs ∪ targets) contains each item.

    Each user adds 1 to at most maxlen+1 distinct items (L2 sensitivity sqrt(maxlen+1) under
    add/remove of a user). Index 0 (padding) is always 0. Exact counts: private data.
    """
    both = np.concatenate([inputs, targets[:, -1:]], axis=1)
    srt = np.sort(both, axis=1)
    first = np.ones_like(srt, dtype=bool)
    first[:, 1:] = srt[:, 1:] != srt[:, :-1]
    ids = srt[first & (srt > 0)]
    counts = np.bincount(ids, minlength=n_items + 1).astype(np.float64)
    counts[0] = 0.0
    return counts


__all__ = ["AMAZON_MAXLEN", "MOVIELENS_MAXLEN", "SeqData", "item_presence", "leave_last_out", "load",
           "pad_left", "read_ratings", "read_sasrec"]
