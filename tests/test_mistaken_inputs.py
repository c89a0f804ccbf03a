"""Mistaken inputs on the command line (issue 70's run-through): each is refused before any work, with exit status 2,
no traceback and a message naming the flag the user typed (`--delta`, not the library's `delta`), or, where it is
accepted, the summary says what was done. Data loading and training are replaced by stubs that fail the test if
they are reached, so every refusal here is shown to come first."""
import json

import numpy as np
import pytest

from jdp import cli, cli_support
from jdp.cli import main


class Reached(Exception):
    """Raised by the stubs: the run got past the checks that had to refuse it."""


def _stop(*args, **kwargs):
    raise Reached


@pytest.fixture
def no_work(monkeypatch):
    """Reading / generating data, drawing a seed and training all fail the test: refusals must come first."""
    from jdp.altmin import cli as altmin_cli
    from jdp.altmin import experiment
    from jdp.seqrec import data as seq_data
    from jdp.seqrec import train as seq_train
    monkeypatch.setattr(altmin_cli, "load_data", _stop)
    monkeypatch.setattr(experiment, "rating_experiment", _stop)
    monkeypatch.setattr(seq_data, "load", _stop)
    monkeypatch.setattr(seq_train, "train", _stop)
    import importlib
    commands = [importlib.import_module(m) for m in cli.SUBCOMMANDS.values()]  # imported before cli is patched
    for mod in [cli, *commands]:
        if hasattr(mod, "noise_seed"):
            monkeypatch.setattr(mod, "noise_seed", _stop)


def _refused(capsys, argv, *needles):
    """`jdp argv` exits 2 before any work with one error line that contains every needle."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "noise seed" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


SMALL = ["--synthetic-size", "500", "100", "5000"]


@pytest.mark.parametrize("argv, needles", [
    # privacy parameters: the one rule (jdp.validation.check_privacy), named by the flag (issue item a)
    (["altmin", "--epsilon", "0", *SMALL], ["jdp altmin: error: --epsilon must be"]),
    (["altmin", "--epsilon", "nan", *SMALL], ["--epsilon must be"]),
    (["altmin", "--epsilon", "1e12", *SMALL], ["--epsilon = 1e+12 is above"]),
    (["altmin", "--delta", "0.5", *SMALL], ["--delta = 0.5 >= 1/n", "500 protected users"]),
    (["altmin", "--delta", "1.5", *SMALL], ["--delta must be in (0, 1)"]),
    (["seqrec", "--data", "synthetic", "--epsilon", "0"], ["jdp seqrec: error: --epsilon must be"]),
    (["seqrec", "--data", "synthetic", "--delta", "0.5", "--n-users", "100"], ["--delta = 0.5 >= 1/n"]),
    # other numbers, named by their flags
    (["altmin", "--synthetic-size", "-5", "100", "5000"], ["--synthetic-size USERS must be >= 1"]),
    (["altmin", "--dim", "-3", *SMALL], ["--dim must be >= 0"]),
    (["altmin", "--steps", "0", *SMALL], ["--steps must be >= 1"]),
    (["altmin", "--mu", "-1", *SMALL], ["--mu must be"]),
    (["altmin", "--rating-range", "5", "1", *SMALL], ["--rating-range must be"]),
    (["altmin", "--seed", "-1", *SMALL], ["--seed must be"]),
    (["seqrec", "--data", "synthetic", "--epochs", "0"], ["--epochs must be"]),
    (["seqrec", "--data", "synthetic", "--batch-size", "-1"], ["--batch-size must be >= 1"]),
    (["seqrec", "--data", "synthetic", "--l2-clip", "-1"], ["--l2-clip must be"]),
    (["seqrec", "--data", "synthetic", "--length-buckets", "a,b"], ["--length-buckets must be"]),
    (["demo", "--users", "-5"], ["jdp demo: error: --users must be >= 1"]),
    # an input that would be ignored is refused
    (["altmin", "--method", "als", "--epsilon", "3", *SMALL], ["--epsilon 3 would be ignored", "als"]),
    (["seqrec", "--data", "synthetic", "--non-private", "--epsilon", "3"], ["--epsilon 3 would be ignored"]),
    (["meta", "--algorithm", "local", "--epsilon", "5"], ["--epsilon 5 would be ignored"]),
    (["altmin", "--method", "als", "--tune", "private", *SMALL], ["--tune private"]),
])
def test_refused_before_any_work_naming_the_flag(no_work, capsys, argv, needles):
    _refused(capsys, argv, *needles)


def test_seqrec_files_are_checked_before_the_data_are_read(no_work, capsys, tmp_path):
    """An existing --checkpoint (without --resume), --resume of a missing one, a missing --public-item-counts or
    --item-catalogue: refused before the data are read (a real dataset takes minutes to load)."""
    existing = tmp_path / "run.ckpt"
    existing.write_bytes(b"x")
    base = ["seqrec", "--data", "synthetic", "--no-progress"]
    _refused(capsys, base + ["--checkpoint", str(existing)], "--checkpoint", "exists", "--resume")
    _refused(capsys, base + ["--resume"], "--resume needs --checkpoint")
    _refused(capsys, base + ["--resume", "--checkpoint", str(tmp_path / "none")], "does not exist")
    _refused(capsys, base + ["--public-item-counts", str(tmp_path / "c.npy")], "--public-item-counts", "does not exist")
    _refused(capsys, base + ["--item-catalogue", str(tmp_path / "u.item")], "--item-catalogue", "does not exist")


def test_altmin_delta_against_the_users_of_a_file_names_the_flag(monkeypatch, capsys, tmp_path):
    """With a file (no --n-users), δ < 1/n is checked against the users read, before training, naming --delta."""
    from jdp.altmin import experiment
    monkeypatch.setattr(experiment, "rating_experiment", _stop)
    path = tmp_path / "u.data"
    path.write_text("".join(f"{u}\t{i}\t{(u * i) % 5 + 1}\t{1000 * u + i}\n" for u in range(1, 13) for i in range(1, 9)))
    err = _refused(capsys, ["altmin", "--data-path", str(path), "--delta", "0.1"], "--delta = 0.1 >= 1/n")
    assert "12 protected users" in err


def test_named_by_flag_renames_rules_not_prose():
    rename = {"epsilon": "--epsilon", "steps": "--steps", "dim": "--dim"}
    assert cli_support.named_by_flag("epsilon = 2e3 is above 1000: at such an epsilon nothing", rename) == \
        "--epsilon = 2e3 is above 1000: at such an epsilon nothing"
    assert cli_support.named_by_flag("dim must be >= 0 and steps >= 1", rename) == "--dim must be >= 0 and --steps >= 1"
    assert cli_support.named_by_flag("item_dim must be >= 1", rename) == "item_dim must be >= 1"


def test_select_inputs(capsys, tmp_path):
    """`jdp select`: an absurd ε (it used to end in a ZeroDivisionError traceback), a folder, a CSV with a header,
    an empty file, NaN scores and mismatched shapes are refused naming the flag, under the command's own name;
    options a command does not use are not offered (argparse refuses them)."""
    np.save(tmp_path / "s.npy", np.ones((3, 4)))
    np.save(tmp_path / "d.npy", np.ones(4))
    np.save(tmp_path / "d3.npy", np.ones(3))
    nan = np.ones((3, 4))
    nan[0, 0] = np.nan
    np.save(tmp_path / "nan.npy", nan)
    (tmp_path / "h.csv").write_text("a,b,c,d\n1,2,3,4\n")
    (tmp_path / "e.csv").write_text("")
    run = ["select", "run", "--epsilon", "1"]
    _refused(capsys, ["select", "run", "--epsilon", "1e12", "--problems", "3", "--k", "4"],
             "jdp select run: error: --epsilon 1e+12 is above")
    _refused(capsys, ["select", "curves", "--epsilons", "1", "1e12", "--trials", "2", "--k", "4"], "--epsilons")
    d = ["--sensitivities", str(tmp_path / "d.npy")]
    _refused(capsys, run + ["--scores", str(tmp_path)] + d, "--scores", "is a directory")
    _refused(capsys, run + ["--scores", str(tmp_path / "h.csv")] + d, "--scores", "header")
    _refused(capsys, run + ["--scores", str(tmp_path / "e.csv")] + d, "--scores", "no numbers")
    _refused(capsys, run + ["--scores", str(tmp_path / "nan.npy")] + d, "--scores", "NaN")
    _refused(capsys, run + ["--scores", str(tmp_path / "s.npy"), "--sensitivities", str(tmp_path / "d3.npy")],
             "--sensitivities must have shape")
    for argv in (["select", "recommend", "--seed", "5"], ["select", "list", "--data-seed", "3"]):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_an_existing_out_file_is_replaced_and_the_summary_says_so(capsys, tmp_path):
    out = tmp_path / "r.json"
    out.write_text("{}")
    assert main(["select", "run", "--epsilon", "1", "--problems", "3", "--k", "4", "--seed", "1",
                 "--out", str(out)]) == 0
    assert "it replaced the file that was there" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["selections"]) == 3
    assert main(["select", "run", "--epsilon", "1", "--problems", "3", "--k", "4", "--seed", "1",
                 "--out", str(tmp_path / "new.json")]) == 0
    assert "replaced" not in capsys.readouterr().out


def test_demo_writes_out_and_plot_before_the_table(monkeypatch, capsys, tmp_path):
    """`jdp demo --out --plot` (training stubbed): both files are written, then the table is printed."""
    pytest.importorskip("matplotlib")
    from jdp.altmin import experiment

    def row(data, cfg, **kwargs):
        private = cfg.method != "als"
        return {"method": cfg.method, "epsilon": cfg.epsilon if private else None, "mu": cfg.mu if private else None,
                "config": {"dim": 0}, "privacy": {"epsilon": cfg.epsilon if private else None},
                "timings": {"fit_seconds": 0.1},
                "metrics": {"rmse_test": 0.95, "rmse_zero_cost_test": 0.97, "rmse_prior_only_test": 1.1,
                            "sliced": {"rmse_test": [1.0, 0.9, 0.93]}}}

    monkeypatch.setattr(experiment, "rating_experiment", row)
    out, png = tmp_path / "demo.json", tmp_path / "demo.png"
    assert main(["demo", "--users", "50", "--items", "10", "--ratings", "300", "--seed", "1",
                 "--out", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert len(json.loads(out.read_text())["rows"]) == 9 and png.stat().st_size > 1000
    assert f"wrote {out}" in printed and f"wrote {png}" in printed


def test_select_refuses_a_sequential_total_beyond_max_epsilon(capsys):
    """--rows-share-data with 10,000 rows at ε = 1 composes to thousands (the accountant did not finish in 200 s):
    refused before any selection; 20 rows compose to a total the report states."""
    _refused(capsys, ["select", "run", "--epsilon", "1", "--rows-share-data", "--problems", "10000", "--k", "5"],
             "--rows-share-data composes 10,000 selections", "1000")
    assert main(["select", "run", "--epsilon", "1", "--rows-share-data", "--problems", "20", "--k", "5",
                 "--seed", "1"]) == 0
    assert "total epsilon" in capsys.readouterr().out
