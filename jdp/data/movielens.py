"""MovieLens readers: ml-100k `u.data`, ml-1m / ml-10m `ratings.dat`, ml-20m / ml-latest `ratings.csv`.

Data plumbing, not a private routine: nothing is released. Raw user and movie ids are remapped
to contiguous 0-based ids in increasing order of the raw id (only ids that occur get an index);
ratings are float32 and timestamps int64 (seconds, as in the files).
"""
from __future__ import annotations

import os
import pathlib

import numpy as np

from jdp.data.interactions import Interactions

# File names looked up, in order, when a directory is given.
_DIR_FILES = ("u.data", "ratings.dat", "ratings.csv")
_COLUMNS = ("user", "item", "rating", "timestamp")


def _remap(raw: np.ndarray) -> tuple[np.ndarray, int]:
    """Contiguous 0-based ids in sorted order of the raw ids; O(n) via a presence table when dense."""
    lo, hi = int(raw.min()), int(raw.max())
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


def load_movielens(path: str | os.PathLike) -> Interactions:
    """Reads MovieLens ratings from a directory or a ratings file.

    A directory must contain `u.data` (ml-100k), `ratings.dat` (ml-1m, ml-10m) or `ratings.csv`
    (ml-20m, ml-25m, ml-latest). A file's format is detected from its first line:
    `user<TAB>item<TAB>rating<TAB>ts`, `user::item::rating::ts`, or csv with header
    `userId,movieId,rating,timestamp`. Returns Interactions with remapped ids (sorted raw ids ->
    0..n-1) and timestamps. Raises FileNotFoundError / ValueError for missing or malformed files.
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
    user, n_users = _remap(df["user"].to_numpy())
    item, n_items = _remap(df["item"].to_numpy())
    rating = df["rating"].to_numpy(dtype=np.float32)
    if not np.isfinite(rating).all():
        raise ValueError(f"{path}: ratings must be finite")
    return Interactions(user, item, rating, n_users, n_items, df["timestamp"].to_numpy(dtype=np.int64))


def load_ml100k(root: str | os.PathLike) -> Interactions:
    """MovieLens 100K from `root/u.data` (100,000 ratings, 943 users, 1,682 items)."""
    root = pathlib.Path(root)
    path = root if root.is_file() else root / "u.data"
    if not path.is_file():
        raise FileNotFoundError(f"ml-100k u.data not found: {path}")
    return load_movielens(path)
