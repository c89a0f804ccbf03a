"""`jdp select` CLI: run with the privacy report, curves, list, recommend, clean errors."""
import json

import numpy as np
import pytest

from jdp.cli import main


def test_select_run_and_report(tmp_path, capsys):
    q = np.random.default_rng(0).normal(size=(50, 8)).astype(np.float32)
    d = np.full(8, 0.5, np.float32)
    np.save(tmp_path / "q.npy", q)
    np.savetxt(tmp_path / "d.csv", d[None], delimiter=",")
    out = tmp_path / "r.json"
    rc = main(["select", "run", "--mechanism", "gem", "--epsilon", "2", "--scores", str(tmp_path / "q.npy"),
               "--sensitivities", str(tmp_path / "d.csv"), "--param", "beta=0.2", "--out", str(out),
               "--plot", str(tmp_path / "run.png")])
    assert rc == 0 and (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = json.loads(out.read_text())
    assert r["problems"] == 50 and len(r["selections"]) == 50 and all(0 <= i < 8 for i in r["selections"])
    slack = 1 + 2.0 ** -12  # the float64 rounding bound every score-comparing selection records
    assert abs(r["privacy"]["pure_epsilon"] - 2.0 * slack) < 1e-9 and r["privacy"]["unit"] == "user"
    assert r["timings"]["selections_per_second"] > 0 and r["mse_vs_best"] >= 0
    # the zero-cost reference beside it: a uniformly random choice, in expectation
    assert r["mse_vs_best_uniform"] == pytest.approx(float(np.mean((q.max(1)[:, None] - q) ** 2)), rel=1e-5)
    rc = main(["select", "run", "--mechanism", "combined-gem", "--epsilon", "1", "--scenario", "polarised-strong",
               "--problems", "20", "--k", "10", "--rows-share-data", "--out", str(out)])
    r = json.loads(out.read_text())
    assert rc == 0 and abs(r["privacy"]["pure_epsilon"] - 20.0 * (0.5 + 0.5 * slack)) < 1e-6


def test_select_curves_list_recommend(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["select", "curves", "--scenario", "bimodal-negative", "--k", "10", "--trials", "3",
                 "--epsilons", "0.5", "2", "--mechanisms", "gem", "mgem", "--out", str(out),
                 "--plot", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    c = json.loads(out.read_text())
    assert c["mse"]["gem"][0] < c["mse"]["mgem"][0]
    capsys.readouterr()
    assert main(["select", "list", "--out", str(tmp_path / "list.json")]) == 0
    listing = json.loads((tmp_path / "list.json").read_text())
    assert "rnmh-nonprivate" not in listing["private"] and "gem" in listing["private"]
    printed = capsys.readouterr().out  # a summary, not the JSON
    assert printed.index("private mechanisms") < printed.index("  gem ") < printed.index("NON-PRIVATE references") \
        < printed.index("  rnmh-nonprivate ")
    assert main(["select", "recommend", "--scenario", "bimodal-negative", "--problems", "2", "--k", "20",
                 "--out", str(tmp_path / "rec.json")]) == 0
    assert json.loads((tmp_path / "rec.json").read_text())["mechanism"] == "gem"
    assert "suggested mechanism: gem" in capsys.readouterr().out


def test_select_errors_are_clean(capsys):
    assert main(["select", "run", "--mechanism", "gem", "--epsilon", "0", "--problems", "3", "--k", "5"]) == 2
    assert "epsilon" in capsys.readouterr().err
    assert main(["select", "run", "--mechanism", "rnmh-nonprivate", "--epsilon", "1", "--problems", "3"]) == 2
    assert "not differentially private" in capsys.readouterr().err
    assert main(["select", "run", "--epsilon", "1", "--scores", "/nonexistent.npy", "--sensitivities", "x"]) == 2


def test_select_run_out_holds_every_selection_and_the_summary_says_the_problems_are_generated(tmp_path, capsys):
    """Issue 70 item 6: --out and --plot hold all B selections (the summary shows --max-print of them and says
    where the rest are); without --scores the summary says on stdout that the problems are generated."""
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["select", "run", "--mechanism", "em", "--epsilon", "1", "--problems", "1500", "--k", "10",
                 "--seed", "2", "--out", str(out), "--plot", str(png), "--max-print", "5"]) == 0
    r = json.loads(out.read_text())
    assert r["problems"] == 1500 and len(r["selections"]) == 1500 and r["source"] == "scenario:bimodal-positive"
    printed = capsys.readouterr().out
    assert "GENERATED" in printed and "bimodal-positive" in printed and "1,500 x 10" in printed
    shown = next(line for line in printed.splitlines() if line.startswith("selected:"))
    assert shown.split()[1:6] == [str(i) for i in r["selections"][:5]] and "1,495 more in --out" in shown
    from jdp import plots
    seen = {}
    real = plots.PLOTS["select run"]
    try:
        plots.PLOTS["select run"] = lambda payload, path: seen.setdefault("n", len(payload["selections"])) and path
        assert main(["select", "run", "--epsilon", "1", "--problems", "1200", "--k", "5", "--seed", "1",
                     "--plot", str(png)]) == 0
    finally:
        plots.PLOTS["select run"] = real
    assert seen["n"] == 1200  # the plot counts every row


def test_select_refuses_options_it_would_ignore(tmp_path, capsys):
    np.save(tmp_path / "q.npy", np.zeros((3, 4)))
    np.save(tmp_path / "d.npy", np.ones(4))
    assert main(["select", "run", "--epsilon", "1", "--sensitivities", str(tmp_path / "d.npy")]) == 2
    assert "--sensitivities without --scores" in capsys.readouterr().err
    assert main(["select", "run", "--epsilon", "1", "--scores", str(tmp_path / "q.npy"), "--sensitivities",
                 str(tmp_path / "d.npy"), "--k", "10", "--problems", "5"]) == 2
    assert "--problems, --k describe generated problems" in capsys.readouterr().err
    assert main(["select", "run", "--epsilon", "1", "--max-print", "-1"]) == 2
