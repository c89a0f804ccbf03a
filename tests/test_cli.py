"""The top-level `jdp` command."""
import pytest

import jdp
from jdp.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"jdp {jdp.__version__}"


def test_a_missing_data_file_is_a_clean_error(capsys, tmp_path):
    code = main(["altmin", "--data", "movielens", "--data-path", str(tmp_path / "missing.dat"), "--epsilon", "1"])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


def test_bad_counts_are_refused_before_any_work(capsys):
    assert main(["select", "curves", "--trials", "0"]) == 2
    assert "--trials must be >= 1" in capsys.readouterr().err
    assert main(["meta", "--clip", "0", "--seed", "1"]) == 2
    assert "--clip" in capsys.readouterr().err


def test_malformed_sequence_file_names_the_line(tmp_path):
    from jdp.seqrec import data
    bad = tmp_path / "seqs.txt"
    bad.write_text("1 2\n1 3\n2 x\n")
    with pytest.raises(ValueError, match=r"seqs.txt:3: expected 2 integers"):
        data.load("amazon-games", path=bad)


def test_a_nonprivate_reference_is_refused_by_select_run_with_where_to_find_it(capsys):
    assert main(["select", "run", "--mechanism", "rnmh-nonprivate", "--epsilon", "1"]) == 2
    err = capsys.readouterr().err
    assert "private mechanisms only" in err and "allow_nonprivate=True" in err
