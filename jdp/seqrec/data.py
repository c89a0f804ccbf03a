"""Sequential-recommendation data: SASRec-format and rating-file readers, leave-last-out split, padding.

Preprocessing follows SASRec (Kang & McAuley 2018): one chronological item sequence per user, items
re-indexed 1..M (0 is padding), leave-last-out split (train = all but the last two items, valid = the
second last, test = the last; users with < 3 items keep everything in train and are not evaluated),
left-padding to `maxlen` keeping the most recent items. One sequence per user, so DP training over
these sequences is user-level.

Readers:
- `read_sasrec(path)`: lines "user item" already in time order (e.g. the Amazon Games `Video.txt`); any
  other layout (a MovieLens file's four fields, '::' or ',' separators) is refused.
- `read_ratings(path)`: MovieLens rating files as published (`jdp.data.movielens`): `u.data` (tab separated:
  user item rating timestamp), `ratings.dat` (`user::item::rating::timestamp`) or `ratings.csv` (with its
  header); every rating is an implicit interaction, ordered by timestamp (ties keep file order). Optional
  SASRec-style one-pass filter on raw counts. Any other file is refused.
`load(name, path)` checks that the file is in the named dataset's format before reading it.

Item vocabulary (which items exist and their ids) — chosen by `vocabulary`, recorded in the SeqData and
carried into the training PrivacyReport:
- "sasrec-exact" (default; the papers' protocol): items are those appearing in the data (read_ratings:
  with >= min_item_count raw interactions), i.e. exact counts of every user's data. NOT private: the
  report states the assumption that this vocabulary is treated as public (`EXACT_VOCAB_ASSUMPTION`).
- "public": a caller-declared public `item_catalogue` (raw ids, e.g. MovieLens u.item / movies.dat via
  `jdp.data.load_movielens_items`) is the vocabulary, in catalogue order, whatever the data contain;
  interactions on other items are dropped row by row. No count of other users' data is used.
- "private": the catalogue is only the candidate set; the items kept are those whose Gaussian-noised
  user count (`private_vocabulary`) reaches min_item_count. Accounted as one release in the report.
The per-user filter (min_user_count on a user's own number of ratings) depends on that user's data
only, so under add/remove of a user it changes nothing about anyone else: it needs no accounting.
"""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from jdp import accounting
from jdp.validation import check_positive

AMAZON_MAXLEN = 50
MOVIELENS_MAXLEN = 200
SYNTHETIC_MAXLEN = 20  # planted_sequences' next-item rule is first-order: a short window suffices
VOCABULARIES = ("sasrec-exact", "public", "private")
FILES = {"amazon-games": "Video.txt", "ml-100k": "u.data", "ml-1m": "ratings.dat"}  # the file `load` reads
EXACT_VOCAB_ASSUMPTION = ("item vocabulary treated as public: built from exact item counts of all users' "
                          "data (SASRec protocol), not covered by epsilon")


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
    # where the vocabulary came from: releases of its private construction and assumptions it rests on,
    # composed into the training report. Default: items 1..n_items as declared by the caller.
    vocab_releases: tuple = ()
    vocab_assumptions: tuple = ("item vocabulary (ids 1..n_items) declared public by the caller",)

    @property
    def n_users(self) -> int:
        return int(self.train_input.shape[0])


SASREC_FORMAT = "the SASRec / Amazon Video.txt format ('user item', one interaction per line, in time order)"


def _read_pairs(path: str | pathlib.Path) -> np.ndarray:
    """[n, 2] int64 (user, item) rows of a SASRec-format file; ValueError naming the format and the first line
    that does not follow it (e.g. a MovieLens file: 4 fields, or '::'-separated)."""
    path = pathlib.Path(path)
    if not path.exists():
        raise ValueError(f"data_path does not exist: {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    tokens = text.split()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    vals = None
    if len(tokens) == 2 * len(lines):  # every line holds two fields (checked below if any is not an integer)
        try:
            vals = np.array(tokens, dtype=np.int64)
        except ValueError:
            pass
    if vals is None:
        for lineno, line in enumerate(text.splitlines(), 1):  # name the first bad line
            fields = line.split()
            if fields and (len(fields) != 2 or not all(f.isdigit() for f in fields)):
                movielens = len(fields) == 4 or "::" in line or line.count(",") == 3
                hint = (": it looks like a MovieLens ratings file (--data ml-100k / ml-1m, "
                        "jdp.seqrec.data.read_ratings)" if movielens else "")
                raise ValueError(f"{path}:{lineno}: expected 2 integers per line, {SASREC_FORMAT}{hint}; "
                                 f"got {line.strip()[:80]!r}")
    if vals is None or vals.size == 0:
        raise ValueError(f"data_path is empty: {path}")
    return vals.reshape(-1, 2)


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


def _catalogue_index(seqs: list[np.ndarray], catalogue: np.ndarray) -> list[np.ndarray]:
    """Raw ids -> 1-based positions in `catalogue` (sorted unique); ids outside it are dropped."""
    out = []
    for s in seqs:
        p = np.minimum(np.searchsorted(catalogue, s), catalogue.size - 1)
        out.append((p[catalogue[p] == s] + 1).astype(np.int32))
    return out


def _check_catalogue(item_catalogue) -> np.ndarray:
    if item_catalogue is None:
        raise ValueError("item_catalogue (public raw item ids) is required for vocabulary 'public' / 'private'")
    cat = np.asarray(item_catalogue)
    if cat.ndim != 1 or cat.size == 0 or not np.issubdtype(cat.dtype, np.integer):
        raise ValueError("item_catalogue must be a non-empty 1-d array of integer item ids")
    if np.unique(cat).size != cat.size:
        raise ValueError("item_catalogue must not contain duplicate ids")
    return np.sort(cat.astype(np.int64))


def private_vocabulary(seqs: list[np.ndarray], item_catalogue, min_item_count: float, max_items_per_user: int,
                       noise_multiplier: float, key, report: accounting.PrivacyReport
                       ) -> tuple[np.ndarray, np.ndarray]:
    """(kept raw item ids, noisy counts [K]): catalogue items whose noisy number of users reaches the threshold.

    Unit: a user (one sequence of raw ids); relation: add/remove a user. Each user counts each distinct
    catalogue item once, and only its `max_items_per_user` most recent distinct ones (a choice made from
    the user's own data), so one user changes at most that many counts by 1: L2 sensitivity
    sqrt(max_items_per_user). The histogram is released with Gaussian noise of std
    noise_multiplier·sqrt(max_items_per_user) by `reattention.private_item_counts` (recorded in `report`);
    the threshold is post-processing. The catalogue (candidate set) is public.
    """
    from jdp.seqrec import reattention as ra  # jax-based; imported only for the private mode

    cat = _check_catalogue(item_catalogue)
    check_positive(min_item_count, "min_item_count", allow_zero=True)
    if int(max_items_per_user) < 1:
        raise ValueError(f"max_items_per_user must be >= 1, got {max_items_per_user}")
    counts = np.zeros(cat.size + 1)  # index 0: padding slot expected by private_item_counts
    for s in _catalogue_index(seqs, cat):  # one-off preprocessing
        rev = s[::-1]
        _, first = np.unique(rev, return_index=True)
        recent = rev[np.sort(first)][:int(max_items_per_user)]  # most recent distinct items first
        counts[recent] += 1.0
    noisy = ra.private_item_counts(key, counts, int(max_items_per_user), noise_multiplier, report,
                                   name="item vocabulary histogram (threshold min_item_count)")[1:]
    return cat[noisy >= min_item_count], noisy


def _vocab(seqs: list[np.ndarray], vocabulary: str, item_catalogue, min_item_count: float,
           max_items_per_user: int | None, noise_multiplier: float, key,
           report: accounting.PrivacyReport | None) -> tuple[list[np.ndarray], int]:
    """Re-indexes raw-id sequences under the chosen vocabulary (see module doc) -> (sequences, n_items)."""
    if vocabulary == "sasrec-exact":  # the papers' protocol: not private, so the report says so
        if report is not None:
            report.assume(EXACT_VOCAB_ASSUMPTION)
        return _reindex(seqs)
    if vocabulary == "public":
        cat = _check_catalogue(item_catalogue)
        if report is not None:
            report.assume(f"item vocabulary: caller-declared public catalogue of {cat.size} items")
        return _catalogue_index(seqs, cat), int(cat.size)
    if report is None:
        raise ValueError("report (a PrivacyReport) is required for vocabulary='private'")
    if max_items_per_user is None:
        raise ValueError("max_items_per_user is required for vocabulary='private'")
    if key is None:
        raise ValueError("key is required for vocabulary='private'")
    kept, _ = private_vocabulary(seqs, item_catalogue, min_item_count, max_items_per_user, noise_multiplier,
                                 key, report)
    if kept.size == 0:
        raise ValueError("the private vocabulary is empty: lower min_item_count or vocab_noise_multiplier")
    report.assume(f"item catalogue of {np.unique(np.asarray(item_catalogue)).size} candidate items declared public")
    return _catalogue_index(seqs, kept), int(kept.size)


def _check_vocabulary(vocabulary: str) -> None:
    if vocabulary not in VOCABULARIES:
        raise ValueError(f"vocabulary must be one of {VOCABULARIES}, got {vocabulary!r}")


def read_sasrec(path: str | pathlib.Path, *, vocabulary: str = "sasrec-exact", item_catalogue=None,
                min_item_count: float = 5.0, max_items_per_user: int | None = None,
                vocab_noise_multiplier: float = 10.0, key=None,
                report: accounting.PrivacyReport | None = None) -> tuple[list[np.ndarray], int]:
    """Reads "user item" lines in time order -> (per-user item sequences, n_items); ids re-indexed 1..M.

    Any other file (a MovieLens ratings file, a csv) is refused with a ValueError naming the expected format.

    vocabulary: see the module doc ("sasrec-exact": the items present in the file, in order of first
    appearance — the published files were already filtered by their authors with exact counts).
    `report` receives the vocabulary's release / assumption.
    """
    _check_vocabulary(vocabulary)
    arr = _read_pairs(path)
    seqs = _group(arr[:, 0], arr[:, 1])
    return _vocab(seqs, vocabulary, item_catalogue, min_item_count, max_items_per_user, vocab_noise_multiplier,
                  key, report)


def read_ratings(path: str | pathlib.Path, min_user_count: int = 5, min_item_count: int = 5, *,
                 vocabulary: str = "sasrec-exact", item_catalogue=None, max_items_per_user: int | None = None,
                 vocab_noise_multiplier: float = 10.0, key=None,
                 report: accounting.PrivacyReport | None = None) -> tuple[list[np.ndarray], int]:
    """Reads a MovieLens ratings file (u.data, ratings.dat or ratings.csv, as published, or its folder) ->
    chronological sequences, n_items. Any other file is refused with a ValueError naming the formats.

    Drops users with fewer than min_user_count raw ratings (their own data only) and sorts each user's
    items by timestamp (stable). vocabulary="sasrec-exact" (SASRec's one-pass filter, NOT private) also
    drops items with fewer than min_item_count raw ratings and re-indexes the rest 1..M by first
    appearance; "public" / "private" build the vocabulary from `item_catalogue` instead (module doc;
    the private threshold counts distinct users per item). `report` receives the release / assumption.
    """
    from jdp.data.movielens import read_ratings_table
    _check_vocabulary(vocabulary)
    _, _, table = read_ratings_table(path)
    users, items, ts = (table[c].to_numpy(np.int64) for c in ("user", "item", "timestamp"))
    raw_users = users
    uc = np.unique(users, return_counts=True)
    keep = np.isin(users, uc[0][uc[1] >= min_user_count])
    if vocabulary == "sasrec-exact":
        ic = np.unique(items, return_counts=True)
        keep &= np.isin(items, ic[0][ic[1] >= min_item_count])
    if not keep.any():
        raise ValueError("no interactions left after filtering (min_user_count / min_item_count)")
    users, items, ts = users[keep], items[keep], ts[keep]
    order = np.lexsort((ts, users))  # by user id, then timestamp; lexsort is stable (ties: file order)
    users, items = users[order], items[order]
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    seqs = np.split(items, starts[1:])
    # Users in order of first appearance in the file.
    uniq, first = np.unique(raw_users[keep], return_index=True)
    seqs = [seqs[i] for i in np.argsort(first, kind="stable")]
    return _vocab(seqs, vocabulary, item_catalogue, min_item_count, max_items_per_user, vocab_noise_multiplier,
                  key, report)


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
         datasets_dir: str | pathlib.Path | None = None, *, vocabulary: str = "sasrec-exact",
         item_catalogue=None, min_item_count: float = 5.0, vocab_noise_multiplier: float = 10.0,
         key=None, delta: float = 1e-5, data_seed: int = 0) -> SeqData:
    """Loads 'amazon-games' (SASRec file), 'ml-100k' (u.data), 'ml-1m' (ratings.dat) or 'synthetic'
    (`jdp.data.synthetic.planted_sequences(seed=data_seed)`, no file: a `path` is refused) and splits it.
    A file not in the named dataset's format is refused before anything else is done (ValueError naming it).

    The file is `path` (or `path/<file>` for a folder), else `datasets_dir/<name>/<file>`;
    `jdp.data.fetch(name)` downloads it: `load("ml-1m", path=fetch("ml-1m"))`. maxlen defaults to 50 for Amazon, 200 for
    MovieLens, 20 for the synthetic data. vocabulary / item_catalogue / min_item_count: see the module doc;
    "private" bounds each user's contribution to its maxlen + 2 most recent distinct items (the most
    a user's train/valid/test windows can hold) and needs `key`. The vocabulary's release or assumption
    is kept in the SeqData and composed into the training report (`delta` only sizes the ledger here).
    """
    if name not in FILES and name != "synthetic":
        raise ValueError(f"data must be one of {sorted([*FILES, 'synthetic'])}, got {name!r}")
    if name == "synthetic" and path is not None:
        raise ValueError(f"path: 'synthetic' generates its sequences (planted_sequences) and reads no file, so "
                         f"{path} would be ignored: drop it, or name the dataset the file holds "
                         f"({', '.join(FILES)})")
    _check_vocabulary(vocabulary)
    if path is None and name != "synthetic":
        if datasets_dir is None:
            raise ValueError(f"give data_path (or datasets_dir); jdp.data.fetch({name!r}) downloads it")
        path = pathlib.Path(datasets_dir) / name / FILES[name]
    if path is not None and pathlib.Path(path).is_dir():  # a dataset folder, e.g. jdp.data.fetch("ml-1m")
        path = pathlib.Path(path) / FILES[name]
    if name in ("ml-100k", "ml-1m") and pathlib.Path(path).is_file():  # the named release's format, else refused
        from jdp.data.movielens import movielens_scale
        movielens_scale(path, release=name)
    if maxlen is None:
        maxlen = (MOVIELENS_MAXLEN if name in ("ml-100k", "ml-1m") else SYNTHETIC_MAXLEN if name == "synthetic"
                  else AMAZON_MAXLEN)
    if maxlen < 1:
        raise ValueError(f"maxlen must be >= 1, got {maxlen}")
    ledger = accounting.PrivacyReport(delta, unit="user", relation=accounting.ADD_OR_REMOVE_ONE)
    opts = dict(vocabulary=vocabulary, item_catalogue=item_catalogue, max_items_per_user=maxlen + 2,
                vocab_noise_multiplier=vocab_noise_multiplier, key=key, report=ledger)
    if name == "synthetic":
        from jdp.data.synthetic import planted_sequences
        seqs, n_items = _vocab(planted_sequences(seed=data_seed)[0], vocabulary, item_catalogue, min_item_count,
                               maxlen + 2, vocab_noise_multiplier, key, ledger)
    elif name == "amazon-games":
        seqs, n_items = read_sasrec(path, min_item_count=min_item_count, **opts)
    else:
        seqs, n_items = read_ratings(path, min_item_count=min_item_count, **opts)
    return dataclasses.replace(leave_last_out(seqs, n_items, maxlen), vocab_releases=tuple(ledger.releases),
                               vocab_assumptions=tuple(ledger.assumptions))


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


__all__ = ["AMAZON_MAXLEN", "EXACT_VOCAB_ASSUMPTION", "MOVIELENS_MAXLEN", "SYNTHETIC_MAXLEN", "VOCABULARIES", "SeqData", "item_presence", "leave_last_out", "load",
           "pad_left", "private_vocabulary", "read_ratings", "read_sasrec"]
