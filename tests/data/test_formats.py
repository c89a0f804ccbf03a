"""Every published MovieLens layout, written here byte for byte in its release's format (headers, separators, csv
quoting, encodings), read with the rating scale the release publishes: from the format and the files beside it,
never from the file's name or the ratings' values; ratings off the scale refused."""
import warnings

import numpy as np
import pytest

from jdp.data import (Interactions, concat, load_ml100k, load_movielens, load_movielens_items, movielens_scale,
                      split_ratings)

# (user, movie, rating, timestamp): raw ids sparse and unsorted, as in the files
WHOLE = [(196, 242, 3, 881250949), (186, 302, 3, 891717742), (22, 377, 1, 878887116), (196, 51, 5, 880606923)]
HALF = [(1, 2, 3.5, 1112486027), (1, 29, 3.5, 1112484676), (2, 32, 0.5, 1112484819), (3, 2, 5.0, 1112484727)]

# movie titles as the releases print them: Latin-1 in ML-100K / ML-1M, UTF-8 in the csv releases; a csv title with
# a comma is quoted and its quotes doubled. "Å" is C3 85 in UTF-8, and 0x85 alone is a line break to
# str.splitlines() once decoded as Latin-1.
LATIN1_TITLES = {242: "Kolya (1996)", 302: "L.A. Confidential (1997)", 377: "Heavyweights (1994)",
                 51: "Legends of the Fall (1994)", 1: "Misérables, Les (1995)"}
CSV_MOVIES = "movieId,title,genres\n" + "".join([
    '2,Jumanji (1995),Adventure|Children|Fantasy\n',
    '11,"American President, The (1995)",Comedy|Drama|Romance\n',
    '29,"City of Lost Children, The (Cité des enfants perdus, La) (1995)",Adventure|Drama|Fantasy|Mystery|Sci-Fi\n',
    '32,Twelve Monkeys (a.k.a. 12 Monkeys) (1995),Mystery|Sci-Fi|Thriller\n',
    '98063,"""Great Performances"" Cats (1998)",Musical\n',
    '140,Åsa-Nisse - Wälkom to Knohult (2011),Comedy\n',
])


def _write_release(root, release: str, first_rating=None):
    """A folder laid out as the published `release` (the first rating replaced by `first_rating` if given);
    returns (folder, ratings file, rows, catalogue ids)."""
    folder = root / {"ml-100k": "ml-100k", "ml-1m": "ml-1m", "ml-10m": "ml-10M100K"}.get(release, release)
    folder.mkdir()

    def rows_of(rows):
        return rows if first_rating is None else [rows[0][:2] + (first_rating,) + rows[0][3:], *rows[1:]]

    if release == "ml-100k":
        rows = rows_of(WHOLE)
        (folder / "u.data").write_text("".join(f"{u}\t{i}\t{r:g}\t{t}\n" for u, i, r, t in rows))
        (folder / "u.item").write_bytes("".join(
            f"{i}|{title}|01-Jan-1995||http://us.imdb.com/M/title-exact?x|0|0|0|1|1|1|0|0|0|0|0|0|0|0|0|0|0|0|0\n"
            for i, title in LATIN1_TITLES.items()).encode("latin-1"))
        (folder / "u.user").write_text("196|49|M|writer|55105\n186|39|F|executive|00000\n22|25|M|writer|40206\n")
        return folder, folder / "u.data", rows, sorted(LATIN1_TITLES)
    if release in ("ml-1m", "ml-10m"):
        rows = rows_of(WHOLE if release == "ml-1m" else HALF)
        # as published: whole-star ratings print without a decimal point in both releases
        (folder / "ratings.dat").write_text("".join(f"{u}::{i}::{r:g}::{t}\n" for u, i, r, t in rows))
        movies = {i: LATIN1_TITLES.get(i, f"Movie {i} (1995)") for i in sorted({r[1] for r in rows} | {1})}
        (folder / "movies.dat").write_bytes("".join(f"{i}::{t}::Drama|Comedy\n" for i, t in movies.items())
                                            .encode("latin-1"))
        if release == "ml-1m":
            (folder / "users.dat").write_text("196::F::1::10::48067\n186::M::56::16::70072\n22::M::25::15::55117\n")
        else:
            (folder / "tags.dat").write_text("15::4973::excellent!::1215184630\n20::1747::politics::1188263867\n")
        return folder, folder / "ratings.dat", rows, sorted(movies)
    rows = rows_of(HALF)  # ml-20m, ml-25m, ml-latest, ml-latest-small: the csv releases, UTF-8, header lines
    (folder / "ratings.csv").write_text("userId,movieId,rating,timestamp\n"
                                        + "".join(f"{u},{i},{r:.1f},{t}\n" for u, i, r, t in rows))
    (folder / "movies.csv").write_text(CSV_MOVIES, encoding="utf-8")
    (folder / "tags.csv").write_text('userId,movieId,tag,timestamp\n3,2,"funny, sad",1439472355\n')
    (folder / "links.csv").write_text("movieId,imdbId,tmdbId\n2,0113497,8844\n11,0112346,9087\n")
    return folder, folder / "ratings.csv", rows, [2, 11, 29, 32, 140, 98063]


RELEASE_SCALES = {"ml-100k": (1.0, 5.0), "ml-1m": (1.0, 5.0), "ml-10m": (0.5, 5.0), "ml-20m": (0.5, 5.0),
                  "ml-25m": (0.5, 5.0), "ml-latest": (0.5, 5.0), "ml-latest-small": (0.5, 5.0)}


@pytest.mark.parametrize("release", list(RELEASE_SCALES))
def test_every_published_layout_reads_with_its_catalogue_and_published_scale(tmp_path, release):
    folder, ratings, rows, catalogue = _write_release(tmp_path, release)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the release is told apart from the files beside it: no warning
        for where in (folder, ratings):
            d = load_movielens(where)
            assert d.rating_range == RELEASE_SCALES[release]
            assert d.rating.tolist() == [float(r) for _, _, r, _ in rows]
            assert d.timestamp.tolist() == [t for *_, t in rows]
        assert movielens_scale(ratings).range == RELEASE_SCALES[release]
        assert load_movielens(ratings, release=release).rating_range == RELEASE_SCALES[release]
    items = load_movielens_items(folder)
    assert items.tolist() == catalogue
    d = load_movielens(folder, item_ids=items, n_users=10)
    assert d.n_items == len(catalogue) and d.n_users == 10
    assert [int(items[i]) for i in d.item] == [i for _, i, _, _ in rows]


def test_movies_csv_quoting_header_and_utf8_titles(tmp_path):
    """The catalogue beside a csv release: header line, quoted titles with commas and doubled quotes, UTF-8 titles
    whose bytes hold 0x85; ids only, in any encoding; a file of another kind is refused, naming the format."""
    f = tmp_path / "movies.csv"
    f.write_text(CSV_MOVIES, encoding="utf-8")
    assert load_movielens_items(f).tolist() == [2, 11, 29, 32, 140, 98063]
    f.write_bytes(b"\xef\xbb\xbf" + CSV_MOVIES.replace("\n", "\r\n").encode("utf-8"))  # BOM and CRLF line ends
    assert load_movielens_items(f).tolist() == [2, 11, 29, 32, 140, 98063]
    f.write_text('movieId,title,genres\n1,"A title with a line\nbreak (1990)",Drama\n2,B (1991),Drama\n')
    assert load_movielens_items(f).tolist() == [1, 2]
    f.write_text("userId,movieId,rating,timestamp\n1,2,3.5,4\n")
    with pytest.raises(ValueError, match="movieId"):
        load_movielens_items(f)


@pytest.mark.parametrize("name", ["my_ratings.txt", "ratings.csv", "data"])
def test_scale_follows_the_format_not_the_file_name(tmp_path, name):
    """u.data's layout under any name is ML-100K's 1-5; csv content under the name u.data is a csv release's 0.5-5."""
    f = tmp_path / name
    f.write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in WHOLE))
    assert load_movielens(f).rating_range == (1.0, 5.0)
    g = tmp_path / "sub" / "u.data"
    g.parent.mkdir()
    g.write_text("userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in HALF))
    assert load_movielens(g).rating_range == (0.5, 5.0)


def test_lone_ratings_dat_uses_the_superset_and_says_so_the_release_or_a_declared_range_decides(tmp_path):
    f = tmp_path / "ratings.dat"
    f.write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in WHOLE))
    with pytest.warns(UserWarning, match="superset 0.5-5.*release='ml-1m'"):
        assert load_movielens(f).rating_range == (0.5, 5.0)
    scale = movielens_scale(f)
    assert scale.range == (0.5, 5.0) and scale.step == 0.5 and "superset" in scale.note
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_movielens(f, release="ml-1m").rating_range == (1.0, 5.0)
        assert load_movielens(f, release="ml-10m").rating_range == (0.5, 5.0)
        assert load_movielens(f, rating_range=(1, 5)).rating_range == (1.0, 5.0)


@pytest.mark.parametrize("release, bad, match", [
    ("ml-100k", 3.5, "not on the grid of ratings 1-5 in whole stars"),
    ("ml-1m", 4.5, "not on the grid"),
    ("ml-1m", 0.0, "outside the scale"),
    ("ml-10m", 4.25, "not on the grid of ratings 0.5-5 in half stars"),
    ("ml-20m", 5.5, "outside the scale"),
    ("ml-latest-small", 0.0, "outside the scale"),
])
def test_ratings_off_the_published_scale_are_refused_and_a_declared_range_overrides(tmp_path, release, bad, match):
    folder, _, _, _ = _write_release(tmp_path, release, first_rating=bad)
    with pytest.raises(ValueError, match=match) as err:
        load_movielens(folder)
    assert "rating_range=(lo, hi)" in str(err.value) and "--rating-range" in str(err.value)
    d = load_movielens(folder, rating_range=(0.0, 6.0))  # the caller's declared scale: range only, no grid
    assert d.rating_range == (0.0, 6.0) and float(d.rating[0]) == bad
    with pytest.raises(ValueError, match="outside the scale"):
        load_movielens(folder, rating_range=(1.0, 4.0))


def test_a_named_release_must_match_the_file(tmp_path):
    folder, ratings, _, _ = _write_release(tmp_path, "ml-100k")
    with pytest.raises(ValueError, match="ml-1m ratings come in the '::'-separated ratings.dat format"):
        load_movielens(ratings, release="ml-1m")
    folder10, ratings10, _, _ = _write_release(tmp_path, "ml-10m")
    with pytest.raises(ValueError, match="tags.dat, which ml-10m ships"):
        load_movielens(ratings10, release="ml-1m")
    with pytest.raises(ValueError, match="release must be one of"):
        load_movielens(ratings, release="ml-100m")
    (tmp_path / "Video.txt").write_text("1 6393\n1 13504\n")
    with pytest.raises(ValueError, match="not a MovieLens ratings file.*Video.txt"):
        load_movielens(tmp_path / "Video.txt")


def test_the_scale_travels_with_the_data_and_altmin_uses_it(tmp_path):
    """Interactions carry the declared scale through subset / splits / concat / merge (binarize drops it); an
    AltMinConfig that leaves rating_range at its default takes the data's, a declared one is kept."""
    from jdp.altmin import AltMinConfig
    from jdp.altmin.model import zero_cost_model
    folder, _, _, _ = _write_release(tmp_path, "ml-100k")
    d = load_movielens(folder)
    parts = split_ratings(d, (0.5, 0.5), seed=0)
    assert all(p.rating_range == (1.0, 5.0) for p in parts)
    assert concat(parts).rating_range == (1.0, 5.0) and d.merge_duplicates().rating_range == (1.0, 5.0)
    assert d.binarize(3.0).rating_range is None
    with pytest.raises(ValueError, match="share rating_range"):
        concat([parts[0], Interactions(parts[1].user, parts[1].item, parts[1].rating, d.n_users, d.n_items)])
    with pytest.raises(ValueError, match="rating_range: 1 ratings lie outside"):
        Interactions(np.array([0]), np.array([0]), np.array([5.5]), 1, 1, rating_range=(1, 5))
    assert AltMinConfig().for_data(d).rating_range == (1.0, 5.0)
    assert AltMinConfig(rating_range=(0.5, 5.0)).for_data(d).rating_range == (0.5, 5.0)  # declared: kept
    assert zero_cost_model(d, AltMinConfig(method="ada-dpals")).mean == 3.0  # the midpoint of 1-5, not 2.75


def test_real_ml100k_is_one_to_five(datasets_dir):
    """The Python readers of the real ML-100K give its published 1-5 scale (they gave 0.5-5 before)."""
    from jdp.altmin import AltMinConfig
    for d in (load_ml100k(datasets_dir / "ml-100k"), load_movielens(datasets_dir / "ml-100k")):
        assert d.rating_range == (1.0, 5.0)
        assert AltMinConfig(method="ada-dpals").for_data(d).rating_range == (1.0, 5.0)
    assert load_movielens_items(datasets_dir / "ml-100k").size == 1682
