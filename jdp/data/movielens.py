"""MovieLens readers: ml-100k `u.data`, ml-1m / ml-10m `ratings.dat`, ml-20m / ml-25m / ml-latest `ratings.csv`.

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

Rating scale. Public, and taken from the published release, never from the ratings or the file's name:
the layout (read from the file's first line) and, for `ratings.dat`, the files the release ships beside it
(`RELEASES`). ML-100K's tab-separated `u.data` and ML-1M's `ratings.dat` are 1–5 in whole stars; ML-10M's
`ratings.dat` and every `ratings.csv` release (ML-20M, ML-25M, ml-latest, ml-latest-small) are 0.5–5 in half
stars. A lone `ratings.dat` (no `users.dat`, ML-1M's, or `tags.dat`, ML-10M's, beside it) gets the superset
0.5–5 in half stars, with a warning: name the release (`release="ml-1m"`) or declare the range. Ratings off
the scale's grid or outside its range are refused; a caller-declared `rating_range` replaces the release's
scale (range only). The result carries the scale (`Interactions.rating_range`).
"""
from __future__ import annotations

import csv
import dataclasses
import io
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


@dataclasses.dataclass(frozen=True)
class RatingScale:
    """A public rating scale: ratings lie in [lo, hi] on the grid lo, lo + step, ..., hi (step None: any value
    in [lo, hi]). `source` says where it comes from; `note` is set when the release could not be told apart and
    a superset was chosen (said to the user: a warning, a note in the CLI's report)."""
    lo: float
    hi: float
    step: float | None
    source: str
    note: str | None = None

    @property
    def range(self) -> tuple[float, float]:
        return (self.lo, self.hi)

    def describe(self) -> str:
        grid = ("any value" if self.step is None else
                {1.0: "whole stars", 0.5: "half stars"}.get(self.step, f"steps of {self.step:g}"))
        return f"ratings {self.lo:g}-{self.hi:g} in {grid} ({self.source})"

    def check(self, rating: np.ndarray, path) -> None:
        """ValueError naming the fix if a rating lies outside [lo, hi] or off the grid."""
        fix = ("if the file uses another scale, declare it: load_movielens(..., rating_range=(lo, hi)), "
               "or --rating-range LO HI on the command line")
        outside = (rating < self.lo) | (rating > self.hi)
        if outside.any():
            raise ValueError(f"{path}: {int(outside.sum())} rating(s) lie outside the scale [{self.lo:g}, {self.hi:g}] "
                             f"of {self.source}, e.g. {float(rating[np.argmax(outside)]):g}; {fix}")
        if self.step is not None:
            k = (rating.astype(np.float64) - self.lo) / self.step
            off = np.abs(k - np.round(k)) > 1e-6
            if off.any():
                raise ValueError(f"{path}: {int(off.sum())} rating(s) are not on the grid of {self.describe()}, "
                                 f"e.g. {float(rating[np.argmax(off)]):g}; {fix}")


WHOLE_STARS = (1.0, 5.0, 1.0)
HALF_STARS = (0.5, 5.0, 0.5)
# The published releases: ratings layout and scale (from each release's README), and the file that tells
# a `ratings.dat` release apart from the other one (ML-1M ships users.dat, ML-10M tags.dat).
RELEASES = {
    "ml-100k": ("tab", WHOLE_STARS, "u.data"),
    "ml-1m": ("colons", WHOLE_STARS, "users.dat"),
    "ml-10m": ("colons", HALF_STARS, "tags.dat"),
    "ml-20m": ("csv", HALF_STARS, None),
    "ml-25m": ("csv", HALF_STARS, None),
    "ml-latest": ("csv", HALF_STARS, None),
    "ml-latest-small": ("csv", HALF_STARS, None),
}
_LAYOUTS = {"tab": "the tab-separated u.data format of ML-100K (user<TAB>item<TAB>rating<TAB>timestamp)",
            "colons": "the '::'-separated ratings.dat format of ML-1M / ML-10M (user::item::rating::timestamp)",
            "csv": "the ratings.csv format of ML-20M / ML-25M / ml-latest (header userId,movieId,rating,timestamp)"}


def _ratings_file(path) -> pathlib.Path:
    """`path` if it is a file, else the ratings file in the folder `path` (FileNotFoundError if none)."""
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"MovieLens path does not exist: {path}")
    if path.is_dir():
        found = [path / name for name in _DIR_FILES if (path / name).is_file()]
        if not found:
            raise FileNotFoundError(f"{path}: no MovieLens ratings file found (looked for {', '.join(_DIR_FILES)})")
        path = found[0]
    return path


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
    hint = (" (it looks like the 'user item' sequence format of Amazon's Video.txt: jdp seqrec --data amazon-games)"
            if len(text.split()) == 2 else "")
    raise ValueError(f"{path}: not a MovieLens ratings file{hint}: expected {_LAYOUTS['tab']}, {_LAYOUTS['colons']} "
                     f"or {_LAYOUTS['csv']}; first line: {text[:80]!r}")


def _identify(file: pathlib.Path, layout: str) -> str | None:
    """The release a ratings file comes from, from its layout and the files published beside it; None when a
    ratings.dat has neither users.dat (ML-1M) nor tags.dat (ML-10M) beside it, or both."""
    if layout == "tab":
        return "ml-100k"
    if layout == "csv":
        return "ml-20m"  # every ratings.csv release has the same scale
    beside = [name for name in ("ml-1m", "ml-10m") if (file.parent / RELEASES[name][2]).is_file()]
    return beside[0] if len(beside) == 1 else None


def movielens_scale(path: str | os.PathLike, *, release: str | None = None, rating_range=None) -> RatingScale:
    """The public rating scale of the MovieLens ratings at `path` (a file or its folder).

    `rating_range`: (lo, hi) declared by the caller (overrides the release's scale; range only, no grid), or a
    RatingScale (returned as it is). `release`: the published release the file comes from (a key of
    `RELEASES`); its layout must match the file's, and a ratings.dat whose folder shows the other release is
    refused. Otherwise the scale follows the file's layout and the files beside it (module docstring): never
    the ratings' values or the file's name.
    """
    if isinstance(rating_range, RatingScale):
        return rating_range
    if rating_range is not None:
        try:
            lo, hi = (float(v) for v in rating_range)
        except (TypeError, ValueError):
            raise ValueError(f"rating_range must be a pair (lo, hi), got {rating_range!r}") from None
        if not (np.isfinite(lo) and np.isfinite(hi) and lo < hi):
            raise ValueError(f"rating_range must be finite with lo < hi, got {rating_range!r}")
        return RatingScale(lo, hi, None, "declared by the caller")
    file = _ratings_file(path)
    layout = _sniff(file)
    found = _identify(file, layout)
    if release is not None:
        if release not in RELEASES:
            raise ValueError(f"release must be one of {sorted(RELEASES)}, got {release!r}")
        if RELEASES[release][0] != layout:
            raise ValueError(f"{file}: {release} ratings come in {_LAYOUTS[RELEASES[release][0]]}, but this file is in "
                             f"{_LAYOUTS[layout]}: name the release it comes from (or read it as any MovieLens file)")
        if layout == "colons" and found is not None and found != release:
            raise ValueError(f"{file}: named {release}, but its folder holds {RELEASES[found][2]}, which {found} ships "
                             f"(and {release} does not): name the release it comes from")
        lo, hi, step = RELEASES[release][1]
        return RatingScale(lo, hi, step, f"the published {release} scale")
    if found is None:
        lo, hi, step = HALF_STARS
        note = (f"{file}: '::'-separated ratings, the ratings.dat format of both ML-1M (1-5, whole stars) and ML-10M "
                f"(0.5-5, half stars), and neither users.dat (ML-1M) nor tags.dat (ML-10M) beside it to tell them "
                f"apart: using their superset 0.5-5 in half stars. Name the release (release='ml-1m', jdp altmin "
                f"--data ml-1m) or declare the scale (rating_range=(1, 5), --rating-range 1 5)")
        return RatingScale(lo, hi, step, "ratings.dat of ML-1M or ML-10M: their superset", note)
    lo, hi, step = RELEASES[found][1]
    source = {"ml-100k": "the ML-100K u.data format", "ml-1m": "ML-1M's ratings.dat (users.dat beside it)",
              "ml-10m": "ML-10M's ratings.dat (tags.dat beside it)",
              "ml-20m": "the ratings.csv format of ML-20M / ML-25M / ml-latest"}[found]
    return RatingScale(lo, hi, step, source)


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
        with open(path, encoding="utf-8-sig", errors="replace") as f:
            first = f.readline().strip().split(",")
        has_header = not first[0].strip().lstrip("-").isdigit()
        if has_header:
            expected = ["userId", "movieId", "rating", "timestamp"]
            if [c.strip() for c in first[:4]] != expected:
                raise ValueError(f"{path}: not a MovieLens ratings file: a csv header must start with "
                                 f"{','.join(expected)}, got {','.join(first)}")
        kw = dict(sep=",", header=0 if has_header else None, names=list(_COLUMNS), usecols=[0, 1, 2, 3],
                  encoding="utf-8-sig")
    try:
        df = pd.read_csv(path, engine="c", dtype=dtypes, skip_blank_lines=True, **kw)
    except (ValueError, pd.errors.ParserError, IndexError) as e:  # bad field count or non-numeric field
        raise ValueError(f"{path}: malformed MovieLens file ({_LAYOUTS[fmt]}): {e}") from None
    if df.isna().to_numpy().any():
        raise ValueError(f"{path}: malformed MovieLens file ({_LAYOUTS[fmt]}): missing fields")
    return df


def read_ratings_table(path: str | os.PathLike):
    """(ratings file, layout, DataFrame with int64 user / item / timestamp and float64 rating columns) of the
    MovieLens ratings at `path` (a file or its folder), rows as in the file. ValueError naming the expected
    formats for any other file. Shared by `load_movielens` and `jdp.seqrec.data.read_ratings`."""
    file = _ratings_file(path)
    layout = _sniff(file)
    df = _read_frame(file, layout)
    if len(df) == 0:
        raise ValueError(f"{file}: no ratings found")
    return file, layout, df


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


def load_movielens(path: str | os.PathLike, *, n_users: int | None = None, item_ids=None,
                   release: str | None = None, rating_range=None) -> Interactions:
    """Reads MovieLens ratings from a directory or a ratings file.

    A directory must contain `u.data` (ml-100k), `ratings.dat` (ml-1m, ml-10m) or `ratings.csv`
    (ml-20m, ml-25m, ml-latest, ml-latest-small). A file's format is detected from its first line:
    `user<TAB>item<TAB>rating<TAB>ts`, `user::item::rating::ts`, or csv with header
    `userId,movieId,rating,timestamp`. Returns Interactions with remapped ids (sorted raw ids ->
    0..n-1), timestamps and the public rating scale (`rating_range`). Raises FileNotFoundError / ValueError
    for missing or malformed files, and ValueError for ratings off the scale.

    n_users: declared public bound on the number of users (≥ the users in the file), used as
    `Interactions.n_users`; default: the number of distinct users in the file (data-dependent).
    item_ids: the public item catalogue (raw ids, e.g. `load_movielens_items(folder)`): item index =
    position in the sorted catalogue, n_items = its size, ratings of other items raise ValueError;
    default: the distinct items in the file (data-dependent). Duplicate rows are kept (see the
    module docstring).
    release / rating_range: the rating scale, see `movielens_scale` and the module docstring (default: the
    published scale of the file's format; a lone ratings.dat gets 0.5-5 in half stars with a warning).
    """
    scale = movielens_scale(path, release=release, rating_range=rating_range)
    path, _, df = read_ratings_table(path)
    if scale.note is not None and not isinstance(rating_range, RatingScale):
        warnings.warn(scale.note, stacklevel=2)
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
    scale.check(rating, path)
    return Interactions(user, item, rating, int(n_users), n_items, df["timestamp"].to_numpy(dtype=np.int64),
                        scale.range)


_ITEM_FILES = ("u.item", "movies.dat", "movies.csv")


def load_movielens_items(path: str | os.PathLike) -> np.ndarray:
    """The public item catalogue: raw movie ids (int64, sorted, unique) from `u.item` (ml-100k), `movies.dat`
    (ml-1m, ml-10m) or `movies.csv` (ml-20m, ml-25m, ml-latest), or a folder holding one.

    These files list the movies independently of who rated them, so they can serve as the declared
    public catalogue (`load_movielens(..., item_ids=...)`). Formats as published: u.item `id|title|...`
    (Latin-1), movies.dat `id::title::genres`, movies.csv with the header `movieId,title,genres` and csv
    quoting (titles with commas are quoted, quotes inside doubled; UTF-8). Only the ids are read, so the
    titles' encoding does not matter; lines are split on newline bytes only.
    """
    path = pathlib.Path(path)
    if path.is_dir():
        found = [path / name for name in _ITEM_FILES if (path / name).is_file()]
        if not found:
            raise FileNotFoundError(f"{path}: no MovieLens item file found (looked for {', '.join(_ITEM_FILES)})")
        path = found[0]
    if not path.is_file():
        raise FileNotFoundError(f"MovieLens item file does not exist: {path}")
    raw = path.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
        raw = raw[3:]
    lines = [ln for ln in raw.split(b"\n") if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: no items found")
    head = lines[0]
    if b"::" in head or (b"|" in head and head.split(b"|", 1)[0].strip().isdigit()):
        sep = b"::" if b"::" in head else b"|"
        fields = [ln.split(sep, 1)[0].strip() for ln in lines]
        what = f"'{sep.decode()}'-separated lines starting with the movie id"
    else:  # movies.csv: a header, then csv records (quoted titles may hold commas, quotes and in principle newlines)
        records = list(csv.reader(io.StringIO(raw.decode("utf-8", errors="replace"), newline="")))
        records = [r for r in records if r and any(f.strip() for f in r)]
        if records and records[0] and not records[0][0].strip().isdigit():
            if records[0][0].strip() != "movieId":
                raise ValueError(f"{path}: not a MovieLens item file: a movies.csv header starts with movieId, got "
                                 f"{','.join(records[0])[:80]!r}")
            records = records[1:]
        fields = [r[0].strip().encode() for r in records]
        what = "csv records starting with the movie id (header movieId,title,genres)"
    bad = [i for i, f in enumerate(fields) if not f.isdigit()]
    if bad:
        raise ValueError(f"{path}: malformed MovieLens item file: expected {what}; record {bad[0] + 1} starts with "
                         f"{fields[bad[0]][:40].decode('latin-1')!r}")
    ids = np.asarray([int(f) for f in fields], np.int64)
    if ids.size == 0:
        raise ValueError(f"{path}: no items found")
    return np.unique(ids)


def load_ml100k(root: str | os.PathLike, *, n_users: int | None = None, item_ids=None) -> Interactions:
    """MovieLens 100K from `root/u.data` (100,000 ratings, 943 users, 1,682 items, ratings 1-5 in whole stars);
    see `load_movielens` for `n_users` / `item_ids` (declared public sizes)."""
    root = pathlib.Path(root)
    path = root if root.is_file() else root / "u.data"
    if not path.is_file():
        raise FileNotFoundError(f"ml-100k u.data not found: {path}")
    return load_movielens(path, n_users=n_users, item_ids=item_ids, release="ml-100k")
