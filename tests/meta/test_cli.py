"""`jdp meta` command: JSON output with privacy report and timings, clean errors."""
import json

import pytest

from jdp.cli import main


def test_meta_cli_runs_and_reports(tmp_path, capsys):
    out = tmp_path / "meta.json"
    # shapes and learner as in tests/meta/test_meta_nsgd.py (200 tasks x 10 points, d = 6, ridge, q = 3): shared jit cache
    rc = main(["meta", "--algorithm", "clustering", "--setting", "multi-cluster", "--q", "3", "--n-tasks", "200",
               "--n-test-tasks", "200", "--n-test-points", "20", "--dim", "6", "--learner", "ridge", "--steps", "5",
               "--epsilon", "5", "--out", str(out), "--plot", str(tmp_path / "meta.png")])
    assert rc == 0 and (tmp_path / "meta.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = json.loads(out.read_text())
    printed = capsys.readouterr().out  # a short summary; the JSON only in --out
    assert f"transfer risk on 200 test tasks: {res['transfer_risk']:.4f}" in printed
    assert "total epsilon = 5.0" in printed and f"wrote {out}" in printed
    assert res["privacy"]["unit"] == "task"
    assert res["privacy"]["epsilon"] == pytest.approx(5.0, rel=1e-3)
    assert "PoissonSampledDpEvent" in res["privacy"]["releases"][0]["event"]
    assert res["transfer_risk"] > 0 and res["local_training_risk"] > 0
    assert set(res["timings"]) == {"generate_s", "train_s", "evaluate_s"}


def test_meta_cli_bad_input_is_clean_error(capsys):
    assert main(["meta", "--epsilon", "-1"]) == 2
    assert "epsilon" in capsys.readouterr().err
    assert main(["meta", "--algorithm", "ftmrl", "--q", "2"]) == 2
