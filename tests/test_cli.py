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
    assert main(["meta", "--l2-clip", "0", "--seed", "1"]) == 2
    assert "--l2-clip must be" in capsys.readouterr().err


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


@pytest.mark.slow  # each CLI's own test also writes its plot (default suite)
def test_every_cli_writes_a_plot(tmp_path):
    """`--plot run.png` on altmin, meta, seqrec, select run and select curves (tiny runs), and the altmin
    warning when the private model loses to the zero-cost baseline is in its JSON whenever the numbers say so."""
    pytest.importorskip("matplotlib")
    import json

    runs = {
        "altmin": ["altmin", "--data", "synthetic", "--synthetic-size", "300", "60", "4000", "--method", "dpals-uniform",
                   "--epsilon", "0.5", "--dim", "2", "--steps", "1", "--seed", "1"],
        "meta": ["meta", "--n-tasks", "30", "--n-test-tasks", "10", "--learner", "ridge", "--dim", "3", "--seed", "1",
                 "--no-progress"],
        "seqrec": ["seqrec", "--data", "synthetic", "--model", "gru", "--non-private", "--epochs", "0.5",
                   "--batch-size", "256", "--maxlen", "8", "--d", "8", "--no-progress", "--seed", "1",
                   "--eval-every", "0.25"],
        "select-run": ["select", "run", "--mechanism", "em", "--epsilon", "1", "--problems", "50", "--k", "10",
                       "--seed", "1"],
        "select-curves": ["select", "curves", "--trials", "4", "--k", "10", "--epsilons", "0.5", "2", "--no-progress"],
    }
    for name, args in runs.items():
        png, out = tmp_path / f"{name}.png", tmp_path / f"{name}.json"
        assert main(args + ["--out", str(out), "--plot", str(png)]) == 0, name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5_000, name
    from jdp.cli_support import PRIVACY_SCOPE
    for name in ("altmin", "meta", "seqrec", "select-run"):  # each result says what its ε covers
        assert json.loads((tmp_path / f"{name}.json").read_text())["privacy_scope"] == PRIVACY_SCOPE, name
    row = json.loads((tmp_path / "altmin.json").read_text())
    worse = row["metrics"]["rmse_test"] > row["metrics"]["rmse_zero_cost_test"]
    assert worse == any("zero-cost baseline" in w for w in row.get("warnings", []))


def test_cli_runs_use_a_persistent_compilation_cache(tmp_path, monkeypatch):
    """Each CLI compiles a program once per shape and machine: JAX's persistent cache under JDP_DATA (or
    JDP_COMPILATION_CACHE; 'off' disables), unless the caller configured one."""
    import jax

    from jdp.cli import enable_compilation_cache
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv("JDP_COMPILATION_CACHE", "off")
        assert enable_compilation_cache() is None and not jax.config.jax_compilation_cache_dir
        monkeypatch.delenv("JDP_COMPILATION_CACHE")
        monkeypatch.setenv("JDP_DATA", str(tmp_path))
        assert enable_compilation_cache() == str(tmp_path / "xla") == jax.config.jax_compilation_cache_dir
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
        assert enable_compilation_cache() == str(tmp_path / "mine")  # the caller's choice is kept
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


@pytest.mark.slow
def test_a_command_imports_only_its_own_subcommand_package():
    # start-up time: `jdp altmin ...` must not import seqrec (flax, the clipping engine); `jdp --help` lists all
    import subprocess
    import sys
    code = ("import sys; from jdp.cli import build_parser; p = build_parser(['altmin', '--help']); "
            "print('jdp.seqrec' in sys.modules, 'jdp.meta' in sys.modules); build_parser([]); "
            "print('jdp.seqrec' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "True"]


def test_demo_flags_private_rows_above_the_zero_cost_baseline(capsys, monkeypatch):
    """`jdp demo` marks every private row whose test RMSE is above the zero-cost model's and says why once."""
    import jdp.altmin.experiment as experiment
    from jdp import demo

    def fake_experiment(data, cfg, seed, split_seed):  # private rows at ε = 1, μ = 1/4 above the zero-cost 1.0
        private = cfg.epsilon is not None
        rmse = 0.9 if not private else (1.01 if cfg.epsilon == 1.0 and cfg.mu == 0.25 else 0.99)
        return {"method": cfg.method, "epsilon": cfg.epsilon, "mu": cfg.mu if private else None,
                "metrics": {"rmse_test": rmse, "rmse_zero_cost_test": 1.0, "rmse_prior_only_test": 1.2,
                            "sliced": {"rmse_test": [rmse] * 5}},
                "privacy": {"epsilon": cfg.epsilon}, "config": {"dim": 0}, "timings": {"fit_seconds": 0.0}}

    monkeypatch.setattr(experiment, "rating_experiment", fake_experiment)
    assert main(["demo", "--users", "50", "--items", "10", "--ratings", "200", "--seed", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    flagged = [line for line in lines if line.endswith(" !")]
    expected = sum(1 for method, eps, mu in demo.RUNS if eps == 1.0 and (mu or 0.25) == 0.25)
    assert len(flagged) == expected and all(line.split()[1] == "1" for line in flagged)
    assert any(line.startswith(f"! {expected} private row(s) above the zero-cost baseline 1.0000") for line in lines)


@pytest.mark.slow
def test_the_console_command_exits_fast_after_a_clean_finish(tmp_path):
    # entry_point skips the interpreter's teardown (os._exit) but still runs the atexit handlers, flushes the
    # streams and passes the exit code on; the result file is complete
    import json
    import subprocess
    import sys
    out = tmp_path / "run.json"
    code = ("import atexit, sys; atexit.register(lambda: print('atexit ran')); from jdp.cli import entry_point; "
            "sys.argv = ['jdp'] + sys.argv[1:]; entry_point()")
    args = ["select", "run", "--mechanism", "em", "--epsilon", "1", "--scenario", "bimodal-positive",
            "--problems", "20", "--k", "5", "--seed", "0", "--out", str(out)]
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("atexit ran")
    assert json.loads(out.read_text())["privacy_scope"]
    refused = subprocess.run([sys.executable, "-c", code, "altmin", "--data", "movielens", "--data-path",
                              str(tmp_path / "missing.dat")], capture_output=True, text=True)
    assert refused.returncode == 2 and "does not exist" in refused.stderr
    assert refused.stdout.rstrip().endswith("atexit ran")
