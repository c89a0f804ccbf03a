"""`jdp seqrec` end to end on ML-100K at a tiny size: JSON with metrics, privacy report, timings, per-epoch
history with ε spent, checkpoint + --resume."""
import json
import os

import pytest

from jdp import cli
from jdp.seqrec import transitions as T


@pytest.mark.slow  # real data, two runs and a resume: CI runs it (make test-slow)
def test_cli_seqrec_ml100k(tmp_path, datasets_dir, capsys):
    out = tmp_path / "run.json"
    ck = tmp_path / "ck.msgpack"
    args = ["seqrec", "--data", "ml-100k", "--data-path", str(datasets_dir / "ml-100k" / "u.data"),
            "--model", "transformer", "--item-init", "random", "--epsilon", "8", "--epochs", "0.2", "--batch-size", "128",
            "--maxlen", "16", "--d", "8", "--blocks", "1", "--chunk-rows", "4096", "--length-buckets", "8",
            "--no-progress", "--out", str(out), "--checkpoint", str(ck), "--seed", "3", "--eval-every", "0.125",
            "--plot", str(tmp_path / "curve.png")]
    assert cli.main(args + ["--time-limit", "1e-9"]) == 0  # out of time after the first of the two steps
    first = json.loads(out.read_text())["timings"]
    assert first["steps_done"] == 1 and first["complete"] is False
    assert cli.main(args) == 2  # an existing checkpoint is never silently overwritten or resumed
    assert cli.main(args + ["--resume"]) == 0
    res = json.loads(out.read_text())
    assert res["timings"]["steps_run"] == 1 and res["timings"]["steps_done"] == 2 and res["timings"]["complete"]
    assert res["history"][-1]["step"] == 2
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # validation every 1/8 epoch = every step (8 steps per epoch): step 1's entry survived the resume
    assert res["history"][0]["step"] == 1 and 0.0 <= res["history"][0]["ndcg_at_10_valid"] <= 1.0
    assert res["history"][-1]["epsilon_spent"] == pytest.approx(res["privacy"]["epsilon"], rel=1e-6)
    assert res["privacy"]["epsilon"] <= 8.0 + 1e-3
    assert [r["name"] for r in res["privacy"]["releases"]] == ["DP-SGD step (Poisson-sampled Gaussian)"]
    assert res["model"] == "transformer" and res["item_counts"] is None and res["transition_prior"] is False
    assert res["steps"] == 2 and res["n_users"] == 943
    for k in ("ndcg_at_10_test", "hit_at_10_test", "ndcg_at_10_valid", "hit_at_10_valid"):
        assert 0.0 <= res["metrics"][k] <= 1.0
    assert res["timings"]["train_s"] > 0 and res["evaluation"]["history_masked"] is False
    assert "total epsilon" in capsys.readouterr().out
    # invalid input: clean error, exit code 2
    assert cli.main(["seqrec", "--data", "ml-100k", "--data-path", str(tmp_path / "nope"), "--no-progress"]) == 2


def test_baseline_warnings_name_every_baseline_the_model_does_not_beat():
    from jdp.seqrec.cli import baseline_warnings
    base = {"zero_cost": {"ndcg_at_10_test": 0.0}, "popularity": {"ndcg_at_10_test": 0.0114}}
    warned = baseline_warnings({"ndcg_at_10_test": 0.0113}, base)     # a real case: DPFormer eps=8, 20 epochs
    assert len(warned) == 1 and "popularity baseline" in warned[0] and "1.1400%" in warned[0]
    assert baseline_warnings({"ndcg_at_10_test": 0.02}, base) == []
    both = baseline_warnings({"ndcg_at_10_test": -1.0}, base)
    assert [("zero-cost" in w, "popularity" in w) for w in both] == [(True, False), (False, True)]
    assert baseline_warnings({}, base) == [] and baseline_warnings({"ndcg_at_10_test": 0.0}, {}) == []


def test_quick_run_lowers_xla_optimisation_only_when_the_caller_set_no_flags(monkeypatch):
    """The quick first run (`--data synthetic`, default epochs) asks XLA for less backend optimisation
    (compilation dominates its 16 steps); flags the caller set are kept, and the run records them."""
    from jdp.seqrec import cli as seqrec_cli
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert seqrec_cli.quick_compile_flags() and os.environ["XLA_FLAGS"] == seqrec_cli.QUICK_XLA_FLAGS
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    assert not seqrec_cli.quick_compile_flags() and os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"


def test_cli_seqrec_transitions_one_release(tmp_path, capsys):
    """`--model transitions`: one release, its report, the baselines beside it, JSON and plot; K by the rule."""
    out, png = tmp_path / "run.json", tmp_path / "bars.png"
    args = ["seqrec", "--data", "synthetic", "--model", "transitions", "--k", "100", "--epsilon", "8", "--seed", "1",
            "--no-progress", "--out", str(out), "--plot", str(png)]
    assert cli.main(args) == 0
    res = json.loads(out.read_text())
    assert [r["name"] for r in res["privacy"]["releases"]] == ["item popularity (per-user norm 1)",
                                                             "item transition sums (per-user Frobenius norm 1)"]
    assert res["privacy"]["epsilon"] == pytest.approx(8.0, rel=1e-3)
    assert res["metrics"]["ndcg_at_10_test"] > res["baselines"]["popularity"]["ndcg_at_10_test"]
    assert "warnings" not in res and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "total epsilon" in capsys.readouterr().out
    # no --k: the public rule sets K from the users and the release's sigma
    assert cli.main(args[:5] + args[7:]) == 0
    ruled = json.loads(out.read_text())
    assert ruled["k_rule"] and ruled["k"] == T.default_k(ruled["n_users"], ruled["noise_multiplier"], ruled["n_items"])
    capsys.readouterr()
    non_private = args[:5] + ["--non-private"] + args[9:]            # the rule needs the release's noise
    assert cli.main(non_private) == 2
    assert "needs --k" in capsys.readouterr().err


@pytest.mark.parametrize("flag, want", [([], None), (["--transition-prior"], True), (["--no-transition-prior"], False)])
def test_the_transition_prior_flag_reaches_the_config_as_given(flag, want):
    """Unset, the config resolves it (`TrainConfig.uses_transition_prior`); either flag is kept as given."""
    from jdp.cli import build_parser
    from jdp.seqrec.cli import _train_config
    args = build_parser().parse_args(["seqrec", "--data", "synthetic", *flag])
    assert _train_config(args, 20).transition_prior is want
