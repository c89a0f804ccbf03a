"""MovieLens readers: ml-100k `u.data`, ml-1m / ml-10m `ratings.dat`, ml-20m / ml-latest `ratings.csv`.

Data plumbing, not a private routine: nothing is released. Raw user and movie ids are remapped
to contiguous 0-based ids in increasing order of the raw id; ratings are float32 and timestamps
int64 (seconds, as in the files). Rows are kept as they are: the MovieLens files have no duplicate
(user, movie) pairs, but a user-supplied file may, and then the user-level private routines reject
it (`jdp.data.check_unique_pairs`) unless the caller merges them (`Interactions.merge_duplicates`).

Sizes. By default n_users / n_items are the numbers of distinct ids IN THE FILE and items get an
index only if rated: data-dependent (one more user can add a user, add a movie and shift the movie
indices), which is fine for reproducing experiments on a published dataset whose sizes are public,
but not for a release. For a release declare them: `item_ids=` the public item catalogue
(`load_movielens_items` reads u.item / movies.dat / movies.csv), so the movie index and n_items do
not depend on the ratings, and `n_users=` a public bound on the number of users (user indices are
never released, only their number is used).
"""
from __future__ import annotations

import os
import pathlib
import warnings

import numpy as np

from jdp.data.interactions import Interactions

# File names looked up, in order, when a directory is given.
_DIR_FILES = ("u.data", "ratings.dat", "ratings.csv")
_COLUMNS = ("user", "item", "rating", "timestamp")


def _remap(raw: np.ndarray, what: str = "ids", path=None) -> tuple[np.ndarray, int]:
    """Contiguous 0-based ids in sorted order of the raw ids; O(n) via a presence table when dense. Ids
    outside MovieLens' own range [1, 2³¹) (negative, zero or huge, e.g. hashed) are remapped too, with a
    warning that says how many: such files are not what the reader was written for."""
    lo, hi = int(raw.min()), int(raw.max())
    if lo < 1 or hi >= 2**31:
        odd = int(np.count_nonzero((raw < 1) | (raw >= 2**31)))
        warnings.warn(f"{path or 'ratings'}: {odd} rows have {what} outside [1, 2^31) (min {lo}, max {hi}); all "
                      f"{what} are remapped to 0..n-1 in sorted order of the raw ids", stacklevel=3)
    span = hi - lo + 1
    if span <= max(1 << 24, 4 * raw.size):
        present = np.zeros(span, dtype=np.bool_)
        present[raw - lo] = True
        index = np.cumsum(present, dtype=np.int64) - 1
        return index[raw - lo].astype(np.int32), int(present.sum())
    uniq, inverse = np.unique(raw, return_inverse=True)
    return inverse.astype(np.int32).reshape(-1), int(uniq.size)


def _sniff(path: pathlib.Path) -> str:
    """'tab' (u.data), 'colons' (ratings.dat) or 'csv' (ratings.csv), from the first non-empty line."""
    with open(path, "rb") as f:
        for line in f:
            text = line.decode("utf-8", errors="replace").strip()
            if text:
                break
        else:
            raise ValueError(f"{path}: file is empty")
    if "::" in text:
        return "colons"
    if "\t" in text:
        return "tab"
    if "," in text:
        return "csv"
    raise ValueError(f"{path}: unrecognised MovieLens format (expected tab-separated u.data, "
                     f"'::'-separated ratings.dat or comma-separated ratings.csv); first line: {text[:80]!r}")


def _read_frame(path: pathlib.Path, fmt: str):
    import pandas as pd

    # C engine everywhere: '::' files are read with sep=':' and every other (empty) column dropped.
    dtypes = {"user": np.int64, "item": np.int64, "rating": np.float64, "timestamp": np.int64}
    if fmt == "tab":
        kw = dict(sep="\t", header=None, names=list(_COLUMNS), usecols=[0, 1, 2, 3])
    elif fmt == "colons":
        kw = dict(sep=":", header=None, names=["user", "_a", "item", "_b", "rating", "_c", "timestamp"],
                  usecols=[0, 2, 4, 6])
    else:
        with open(path, encoding="utf-8", errors="replace") as f:
            first = f.readline().strip().split(",")
        has_header = not first[0].strip().lstrip("-").isdigit()
        if has_header:
            expected = ["userId", "movieId", "rating", "timestamp"]
            if [c.strip() for c in first[:4]] != expected:
                raise ValueError(f"{path}: csv header must start with {','.join(expected)}, got {','.join(first)}")
        kw = dict(sep=",", header=0 if has_header else None, names=list(_COLUMNS), usecols=[0, 1, 2, 3])
    try:
        df = pd.read_csv(path, engine="c", dtype=dtypes, skip_blank_lines=True, **kw)
    except (ValueError, pd.errors.ParserError, IndexError) as e:  # bad field count or non-numeric field
        raise ValueError(f"{path}: malformed MovieLens file ({fmt} format): {e}") from None
    if df.isna().to_numpy().any():
        raise ValueError(f"{path}: malformed MovieLens file ({fmt} format): missing fields")
    return df


def _declared_items(raw: np.ndarray, item_ids, path) -> tuple[np.ndarray, int]:
    """Item index = position of the raw id in the sorted public catalogue `item_ids`."""
    catalogue = np.unique(np.asarray(item_ids).reshape(-1))
    if catalogue.size == 0 or not np.issubdtype(catalogue.dtype, np.integer):
        raise ValueError(f"item_ids must be a non-empty array of integer raw item ids, got dtype {catalogue.dtype}")
    idx = np.searchsorted(catalogue, raw)
    missing = (idx >= catalogue.size) | (catalogue[np.minimum(idx, catalogue.size - 1)] != raw)
    if missing.any():
        raise ValueError(f"item_ids: {int(missing.sum())} ratings in {path} are of items not in the declared "
                         f"catalogue, e.g. raw item id {int(raw[np.argmax(missing)])}")
    return idx.astype(np.int32), int(catalogue.size)


def load_movielens(path: str | os.PathLike, *, n_users: int | None = None, item_ids=None) -> Interactions:
    """Reads MovieLens ratings from a directory or a ratings file.

    A directory must contain `u.data` (ml-100k), `ratings.dat` (ml-1m, ml-10m) or `ratings.csv`
    (ml-20m, ml-25m, ml-latest). A file's format is detected from its first line:
    `user<TAB>item<TAB>rating<TAB>ts`, `user::item::rating::ts`, or csv with header
    `userId,movieId,rating,timestamp`. Returns Interactions with remapped ids (sorted raw ids ->
    0..n-1) and timestamps. Raises FileNotFoundError / ValueError for missing or malformed files.

    n_users: declared public bound on the number of users (≥ the users in the file), used as
    `Interactions.n_users`; default: the number of distinct users in the file (data-dependent).
    item_ids: the public item catalogue (raw ids, e.g. `load_movielens_items(folder)`): item index =
    position in the sorted catalogue, n_items = its size, ratings of other items raise ValueError;
    default: the distinct items in the file (data-dependent). Duplicate rows are kept (see the
    module docstring).
    """
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"MovieLens path does not exist: {path}")
    if path.is_dir():
        found = [path / name for name in _DIR_FILES if (path / name).is_file()]
        if not found:
            raise FileNotFoundError(f"{path}: no MovieLens ratings file found (looked for {', '.join(_DIR_FILES)})")
        path = found[0]
    df = _read_frame(path, _sniff(path))
    if len(df) == 0:
        raise ValueError(f"{path}: no ratings found")
    user, n_present = _remap(df["user"].to_numpy(), "user ids", path)
    if n_users is None:
        n_users = n_present
    elif isinstance(n_users, (bool, np.bool_)) or not isinstance(n_users, (int, np.integer)) or n_users < n_present:
        raise ValueError(f"n_users must be an integer >= the {n_present} users in {path}, got {n_users!r}")
    if item_ids is None:
        item, n_items = _remap(df["item"].to_numpy(), "item ids", path)
    else:
        item, n_items = _declared_items(df["item"].to_numpy(), item_ids, path)
    rating = df["rating"].to_numpy(dtype=np.float32)
    if not np.isfinite(rating).all():
        raise ValueError(f"{path}: ratings must be finite")
    return Interactions(user, item, rating, int(n_users), n_items, df["timestamp"].to_numpy(dtype=np.int64))


_ITEM_FILES = ("u.item", "movies.dat", "movies.csv")


def load_movielens_items(path: str | os.PathLike) -> np.ndarray:
    """The public item catalogue: raw movie ids (int64, sorted, unique) from `u.item` (ml-100k),
    `movies.dat` (ml-1m, ml-10m) or `movies.csv` (ml-20m, ml-latest), or a folder holding one.

    These files list the movies independently of who rated them, so they can serve as the declared
    public catalogue (`load_movielens(..., item_ids=...)`).
    """
    path = pathlib.Path(path)
    if path.is_dir():
        found = [path / name for name in _ITEM_FILES if (path / name).is_file()]
        if not found:
            raise FileNotFoundError(f"{path}: no MovieLens item file found (looked for {', '.join(_ITEM_FILES)})")
        path = found[0]
    if not path.is_file():
        raise FileNotFoundError(f"MovieLens item file does not exist: {path}")
    lines = [ln for ln in path.read_bytes().decode("latin-1").splitlines() if ln.strip()]
    sep = "::" if "::" in lines[0] else "|" if "|" in lines[0] else ","
    if sep == "," and not lines[0].split(",", 1)[0].strip().isdigit():
        lines = lines[1:]  # movies.csv header: movieId,title,genres
    try:
        ids = np.asarray([int(ln.split(sep, 1)[0]) for ln in lines], np.int64)
    except ValueError:
        raise ValueError(f"{path}: malformed MovieLens item file (the first field must be the movie id)") from None
    if ids.size == 0:
        raise ValueError(f"{path}: no items found")
    return np.unique(ids)


def load_ml100k(root: str | os.PathLike, *, n_users: int | None = None, item_ids=None) -> Interactions:
    """MovieLens 100K from `root/u.data` (100,000 ratings, 943 users, 1,682 items); see `load_movielens`
    for `n_users` / `item_ids` (declared public sizes)."""
    root = pathlib.Path(root)
    path = root if root.is_file() else root / "u.data"
    if not path.is_file():
        raise FileNotFoundError(f"ml-100k u.data not found: {path}")
    return load_movielens(path, n_users=n_users, item_ids=item_ids)
