"""The data inputs of `jdp altmin` and `jdp seqrec`: a given --data-path is read (its format from the file) or
refused with the reason, never ignored; the rating scale is the published release's; a file in another dataset's
format is refused before any training. Training is replaced by a stub that stops the run with the data it got."""
import numpy as np
import pytest

from jdp.cli import main

U_DATA = "".join(f"{u}\t{i}\t{(u * i) % 5 + 1}\t{1000 * u + i}\n" for u in range(1, 13) for i in range(1, 9))
VIDEO_TXT = "".join(f"{u} {i}\n" for u in range(1, 13) for i in range(1, 9))


class Reached(Exception):
    """Raised by the stubs: the run got past loading, with these arguments."""


@pytest.fixture
def altmin_stub(monkeypatch):
    """Replaces the altmin experiment: records (data, cfg) and stops the run."""
    from jdp.altmin import experiment
    seen = {}

    def stub(data, cfg, **kw):
        seen.update(data=data, cfg=cfg)
        raise Reached

    monkeypatch.setattr(experiment, "rating_experiment", stub)
    return seen


@pytest.fixture
def no_training(monkeypatch):
    """seqrec's training and single release must never start in these tests."""
    from jdp.seqrec import train as train_mod
    from jdp.seqrec import transitions

    def stub(*a, **kw):
        raise Reached

    monkeypatch.setattr(train_mod, "train", stub)
    monkeypatch.setattr(transitions, "fit", stub)


def test_altmin_reads_a_given_path_without_data_and_its_scale_from_the_format(tmp_path, altmin_stub):
    f = tmp_path / "my.data"  # u.data's layout under another name: ML-100K's 1-5, read, not replaced by synthetic
    f.write_text(U_DATA)
    with pytest.raises(Reached):
        main(["altmin", "--data-path", str(f), "--epsilon", "1"])
    assert altmin_stub["data"].nnz == 96 and altmin_stub["data"].n_users == 12
    assert tuple(altmin_stub["cfg"].rating_range) == (1.0, 5.0)
    with pytest.raises(Reached):  # no input at all: the generated quick run
        main(["altmin", "--synthetic-size", "50", "20", "400"])
    assert altmin_stub["data"].nnz == 400


@pytest.mark.parametrize("data", ["synthetic", "synthetic-movielens"])
def test_altmin_refuses_a_path_it_would_not_read(tmp_path, capsys, data, altmin_stub):
    f = tmp_path / "u.data"
    f.write_text(U_DATA)
    assert main(["altmin", "--data", data, "--data-path", str(f)]) == 2
    err = capsys.readouterr().err
    assert "--data-path" in err and "ignored" in err and "--data movielens" in err
    assert main(["altmin", "--data", data, "--n-users", "100"]) == 2
    assert "--n-users" in capsys.readouterr().err
    assert main(["altmin", "--data-path", str(f), "--data-sha256", "ab" * 32]) == 2
    assert "downloads nothing" in capsys.readouterr().err
    assert "data" not in altmin_stub  # nothing ran


def test_altmin_refuses_a_file_that_is_no_movielens_ratings_file(tmp_path, capsys, altmin_stub):
    f = tmp_path / "Video.txt"
    f.write_text(VIDEO_TXT)
    assert main(["altmin", "--data-path", str(f)]) == 2
    err = capsys.readouterr().err
    assert "not a MovieLens ratings file" in err and "amazon-games" in err


def test_altmin_reads_a_csv_release_folder_with_its_quoted_catalogue(tmp_path, altmin_stub):
    """ML-20M / 25M / latest layout: ratings.csv and movies.csv with a header and quoted titles."""
    folder = tmp_path / "ml-latest-small"
    folder.mkdir()
    (folder / "ratings.csv").write_text("userId,movieId,rating,timestamp\n"
                                        + "".join(f"{u},{i},{(u + i) % 10 / 2 + 0.5:.1f},{u * 100 + i}\n"
                                                  for u in range(1, 9) for i in (1, 2, 11, 98063)))
    (folder / "movies.csv").write_text('movieId,title,genres\n1,Toy Story (1995),Animation\n2,Jumanji (1995),Fantasy\n'
                                       '11,"American President, The (1995)",Comedy|Drama\n'
                                       '98063,"""Great Performances"" Cats (1998)",Musical\n'
                                       '140,Åsa-Nisse - Wälkom to Knohult (2011),Comedy\n', encoding="utf-8")
    for path in (folder, folder / "ratings.csv"):
        with pytest.raises(Reached):
            main(["altmin", "--data-path", str(path)])
        d = altmin_stub["data"]
        assert d.nnz == 32 and d.n_items == 5  # the catalogue beside it, 140 unrated
        assert tuple(altmin_stub["cfg"].rating_range) == (0.5, 5.0)


def test_altmin_scale_notes_lone_ratings_dat_named_release_and_declared_range(tmp_path, capsys, altmin_stub):
    from jdp.altmin.cli import load_data
    f = tmp_path / "ratings.dat"
    f.write_text(U_DATA.replace("\t", "::"))
    data, scale, notes = load_data("movielens", str(f))
    assert scale == (0.5, 5.0) and any("superset 0.5-5" in n for n in notes)
    assert any(n.startswith("rating scale: ratings 0.5-5 in half stars") for n in notes)
    data, scale, notes = load_data("ml-1m", str(f))
    assert scale == (1.0, 5.0) and data.rating_range == (1.0, 5.0) and "the published ml-1m scale" in notes[0]
    with pytest.raises(Reached):
        main(["altmin", "--data", "ml-1m", "--data-path", str(f)])
    assert tuple(altmin_stub["cfg"].rating_range) == (1.0, 5.0)
    g = tmp_path / "u.data"
    assert U_DATA.startswith("1\t1\t2\t1001\n")
    g.write_text(U_DATA.replace("1\t1\t2\t1001", "1\t1\t3.5\t1001", 1))
    assert main(["altmin", "--data-path", str(g)]) == 2  # off the whole-star grid of the u.data format
    err = capsys.readouterr().err
    assert "not on the grid of ratings 1-5 in whole stars" in err and "--rating-range" in err
    with pytest.raises(Reached):  # the user's declared scale overrides the format's
        main(["altmin", "--data-path", str(g), "--rating-range", "0.5", "5"])
    assert tuple(altmin_stub["cfg"].rating_range) == (0.5, 5.0)
    assert main(["altmin", "--data", "ml-1m", "--data-path", str(g)]) == 2  # u.data is not ML-1M's format
    assert "ml-1m ratings come in the '::'-separated" in capsys.readouterr().err


def test_seqrec_refuses_a_path_with_synthetic_data(tmp_path, capsys, no_training):
    f = tmp_path / "u.data"
    f.write_text(U_DATA)
    assert main(["seqrec", "--data", "synthetic", "--data-path", str(f), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--data-path" in err and "ignored" in err and "--data amazon-games" in err
    from jdp.seqrec import data
    with pytest.raises(ValueError, match="reads no file"):
        data.load("synthetic", path=f)


@pytest.mark.parametrize("name, content, match", [
    ("amazon-games", U_DATA, "the SASRec / Amazon Video.txt format.*looks like a MovieLens ratings file"),
    ("amazon-games", U_DATA.replace("\t", "::"), "the SASRec / Amazon Video.txt format"),
    ("amazon-games", "userId,movieId,rating,timestamp\n1,2,3.5,4\n", "the SASRec / Amazon Video.txt format"),
    ("ml-100k", VIDEO_TXT, "not a MovieLens ratings file.*amazon-games"),
    ("ml-1m", VIDEO_TXT, "not a MovieLens ratings file"),
    ("ml-1m", U_DATA, "ml-1m ratings come in the '::'-separated ratings.dat format"),
    ("ml-100k", U_DATA.replace("\t", "::"), "ml-100k ratings come in the tab-separated u.data format"),
])
def test_seqrec_refuses_a_file_in_another_format_before_training(tmp_path, capsys, no_training, name, content, match):
    f = tmp_path / "data.txt"
    f.write_text(content)
    assert main(["seqrec", "--data", name, "--data-path", str(f), "--no-progress", "--epochs", "1"]) == 2
    import re
    assert re.search(match, capsys.readouterr().err)


def test_seqrec_reads_files_in_their_own_format(tmp_path, no_training):
    """The checks pass the right files: training is reached (the stub) for each dataset's own format."""
    for name, content in (("amazon-games", VIDEO_TXT), ("ml-100k", U_DATA), ("ml-1m", U_DATA.replace("\t", "::"))):
        f = tmp_path / f"{name}.txt"
        f.write_text(content)
        with pytest.raises(Reached):
            main(["seqrec", "--data", name, "--data-path", str(f), "--no-progress", "--min-item-count", "1"])
    from jdp.seqrec import data
    seqs, n = data.read_sasrec(tmp_path / "amazon-games.txt")
    assert n == 8 and len(seqs) == 12 and all(np.array_equal(s, np.arange(1, 9)) for s in seqs)


def test_seqrec_amazon_games_refuses_the_real_ml100k(datasets_dir, capsys, no_training):
    assert main(["seqrec", "--data", "amazon-games", "--data-path", str(datasets_dir / "ml-100k" / "u.data"),
                 "--no-progress"]) == 2
    assert "the SASRec / Amazon Video.txt format" in capsys.readouterr().err
