import numpy as np
import pytest

from jdp.data import load_ml100k, load_movielens

# Raw ids deliberately sparse and unsorted: 7 < 30 < 100 (users), 5 < 12 < 300 (items).
ROWS = [(30, 300, 4.0, 881250949), (7, 12, 3.5, 891717742), (100, 5, 1.0, 878887116), (7, 300, 5.0, 100)]
EXPECT_USER = [1, 0, 2, 0]
EXPECT_ITEM = [2, 1, 0, 2]


def _write(tmp_path, name, fmt):
    if fmt == "tab":
        lines = [f"{u}\t{i}\t{r:g}\t{t}" for u, i, r, t in ROWS]
    elif fmt == "colons":
        lines = [f"{u}::{i}::{r:g}::{t}" for u, i, r, t in ROWS]
    else:
        lines = ["userId,movieId,rating,timestamp"] + [f"{u},{i},{r:g},{t}" for u, i, r, t in ROWS]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("name, fmt", [("u.data", "tab"), ("ratings.dat", "colons"), ("ratings.csv", "csv")])
@pytest.mark.parametrize("as_dir", [False, True])
def test_formats_remap_values_timestamps(tmp_path, name, fmt, as_dir):
    path = _write(tmp_path, name, fmt)
    d = load_movielens(tmp_path if as_dir else path, rating_range=(0.5, 5.0))  # declared: 3.5 is off u.data's grid
    assert (d.n_users, d.n_items, d.nnz) == (3, 3, 4)
    assert d.user.tolist() == EXPECT_USER and d.item.tolist() == EXPECT_ITEM
    assert d.rating.tolist() == [r for _, _, r, _ in ROWS]
    assert d.timestamp.tolist() == [t for *_, t in ROWS]


def test_missing_files_raise(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_movielens(tmp_path / "nope.dat")
    with pytest.raises(FileNotFoundError, match="ratings"):
        load_movielens(tmp_path)  # empty directory
    with pytest.raises(FileNotFoundError):
        load_ml100k(tmp_path)


@pytest.mark.parametrize("name,text,match", [
    ("bad.dat", "1::2::3::4\n1::x::3::4\n", "malformed"),
    ("short.data", "1\t2\t3\t4\n1\t2\n", "malformed"),
    ("nan.csv", "userId,movieId,rating,timestamp\n1,2,nan,4\n", None),
    ("wrong.csv", "a,b,c,d\n1,2,3,4\n", "header"),
    ("empty.dat", "\n", "empty"),
])
def test_malformed_files_raise(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_movielens(path)


def test_real_ml100k(datasets_dir):
    d = load_ml100k(datasets_dir / "ml-100k")
    assert (d.nnz, d.n_users, d.n_items) == (100_000, 943, 1_682)
    # u.data's first line is "196 242 3 881250949"; ids 1..943 / 1..1682 are all present, so remap = id - 1.
    assert (d.user[0], d.item[0], d.rating[0], d.timestamp[0]) == (195, 241, 3.0, 881250949)
    assert d.user_counts().min() >= 20  # ml-100k: every user rated at least 20 movies
    assert set(np.unique(d.rating).tolist()) == {1.0, 2.0, 3.0, 4.0, 5.0}
    assert abs(float(d.rating.mean()) - 3.52986) < 1e-4


def test_unusual_raw_ids_are_remapped_with_a_warning_and_the_scale_follows_the_format(tmp_path):
    """Negative or huge raw ids are remapped (sorted order) and the reader says how many rows had them;
    `jdp altmin --data movielens` takes the public rating scale from the format (u.data: 1-5) or
    --rating-range, never from the ratings."""
    import warnings

    from jdp.altmin.cli import load_data
    (tmp_path / "u.data").write_text("-5\t10\t4\t1\n100000000000\t10\t3\t2\n7\t20\t5\t3\n")
    with pytest.warns(UserWarning, match="2 rows have user ids outside"):
        data = load_movielens(tmp_path / "u.data")
    assert list(data.user) == [0, 2, 1] and data.n_users == 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_data("movielens", str(tmp_path / "u.data"))[1] == (1.0, 5.0)
        assert load_data("movielens", str(tmp_path), rating_range=(0.0, 10.0))[1] == (0.0, 10.0)
    (tmp_path / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,2,3.5,4\n")
    assert load_data("movielens", str(tmp_path / "ratings.csv"))[1] == (0.5, 5.0)
