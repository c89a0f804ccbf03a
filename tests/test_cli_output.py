"""Issue 70 (CLI behaviour and output): outputs checked before any work, quiet exit on a closed pipe, one
output style (summary on stdout, JSON only in --out), defaults in --help, strict JSON, --max-minutes."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from jdp import cli, cli_support
from jdp.cli import main

# one command line per subcommand, each tiny; none of them may start work when an output cannot be written
COMMANDS = {
    "altmin": ["altmin", "--synthetic-size", "300", "60", "4000", "--dim", "2", "--steps", "1", "--seed", "1"],
    "seqrec": ["seqrec", "--data", "synthetic", "--no-progress", "--seed", "1"],
    "meta": ["meta", "--n-tasks", "30", "--seed", "1", "--no-progress"],
    "select run": ["select", "run", "--epsilon", "1", "--seed", "1"],
    "select curves": ["select", "curves", "--no-progress"],
    "demo": ["demo", "--seed", "1"],
}
PLOTTING = ("altmin", "seqrec", "meta", "select run", "select curves")


def _strict(text: str):
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if a command gets past the output checks (the compilation cache is set up just before a
    command's work starts)."""
    def started():
        raise AssertionError("the command started its work")
    monkeypatch.setattr(cli, "enable_compilation_cache", started)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_unwritable_outputs_are_refused_before_any_work(name, tmp_path, capsys, no_work):
    missing = tmp_path / "no-such-dir"
    assert main(COMMANDS[name] + ["--out", str(missing / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "does not exist" in err and "mkdir -p" in err and "nothing was run" in err
    assert main(COMMANDS[name] + ["--out", str(tmp_path)]) == 2  # a folder, not a file
    assert "is a directory" in capsys.readouterr().err
    if name in PLOTTING:
        assert main(COMMANDS[name] + ["--plot", str(missing / "r.png")]) == 2
        assert "--plot" in capsys.readouterr().err
        assert main(COMMANDS[name] + ["--plot", str(tmp_path / "curve")]) == 2  # matplotlib would add .png
        assert "has no suffix" in capsys.readouterr().err
    assert not missing.exists() and list(tmp_path.iterdir()) == []  # nothing created, no probe file left


def test_plot_without_matplotlib_is_refused_at_start(tmp_path, capsys, monkeypatch, no_work):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert main(COMMANDS["altmin"] + ["--plot", str(tmp_path / "r.png")]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "pip install" in err and "Traceback" not in err


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_folder_is_refused_before_any_work(tmp_path, capsys, no_work):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        assert main(COMMANDS["meta"] + ["--out", str(folder / "r.json")]) == 2
        assert "cannot write" in capsys.readouterr().err
    finally:
        folder.chmod(0o700)


def _jdp(*args, close_stdout=False, timeout=120):
    """Runs the console command (`entry_point`) in a subprocess; `close_stdout`: its reader is gone at once,
    as after `| head -0`."""
    code = "import sys; from jdp.cli import entry_point; sys.argv = ['jdp'] + sys.argv[1:]; entry_point()"
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if close_stdout:
        proc.stdout.close()
        err = proc.stderr.read().decode()
        return proc.wait(timeout), "", err
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.slow
def test_a_closed_pipe_ends_quietly_like_a_unix_tool():
    """`jdp ... | head`: no traceback, no "error: Broken pipe"; exit status 0 or 141 (128 + SIGPIPE)."""
    for args in (["select", "list"], ["seqrec", "--help"]):
        code, _, err = _jdp(*args, close_stdout=True)
        assert code in (0, cli.BROKEN_PIPE_EXIT) and err == "", (args, code, err)


def test_broken_pipe_in_main_is_quiet(monkeypatch, capsys):
    def run(args):
        raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(cli, "_quiet_broken_pipe", lambda: cli.BROKEN_PIPE_EXIT)  # keep pytest's stdout
    monkeypatch.setattr(cli, "enable_compilation_cache", lambda: None)
    import jdp.selection.cli as select_cli
    monkeypatch.setattr(select_cli, "run", run)
    assert main(["select", "list"]) == cli.BROKEN_PIPE_EXIT
    assert capsys.readouterr().err == ""


def test_help_shows_defaults_and_groups():
    """--help states every default (ε is 1 for altmin, 3 for meta, 8 for seqrec); seqrec's flags are grouped."""
    texts = {}
    for name in ("altmin", "meta", "seqrec", "demo"):
        parser = cli.build_parser([name])
        sub = next(a for a in parser._actions if a.dest == "command").choices[name]
        texts[name] = " ".join(sub.format_help().split())
    assert "--epsilon EPSILON total ε (default: 1.0); refused with the non-private 'als'" in texts["altmin"]
    assert "--epsilon EPSILON (default: 3.0)" in texts["meta"]
    assert "--epsilon EPSILON (default: 8.0)" in texts["seqrec"]
    assert "--delta DELTA (default: 1e-05)" in texts["seqrec"] and "--users USERS (default: 20000)" in texts["demo"]
    assert "(default: None)" not in texts["seqrec"] and "(default: False)" not in texts["seqrec"]
    for heading in ("data:", "privacy:", "model:", "training:", "evaluation:", "long runs, progress and output:"):
        assert f" {heading} " in texts["seqrec"], heading
    assert texts["seqrec"].index("privacy:") < texts["seqrec"].index("--epsilon EPSILON (default") \
        < texts["seqrec"].index("model:")


def test_an_argument_error_shows_the_full_command(capsys):
    for args, usage in ((["altmin", "--bogus"], "usage: jdp altmin "), (["select", "run", "--epsilon", "1", "x"],
                                                                       "usage: jdp select run ")):
        with pytest.raises(SystemExit) as stop:
            main(args)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.startswith(usage) and "{" + args[0] + "}" not in err, err


def test_result_json_is_strict():
    payload = {"a": float("nan"), "b": [float("inf"), -float("inf"), 1.5], "c": np.float32("nan"),
               "d": np.array([1.0, np.nan]), "e": (np.int64(3), np.bool_(True)), "f": {"g": math.inf}}
    text = cli_support.result_json(payload)
    got = _strict(text)
    assert got["a"] is None and got["b"] == [None, None, 1.5] and got["c"] is None and got["d"] == [1.0, None]
    assert got["e"] == [3, True] and got["f"] == {"g": None} and got["privacy_scope"] == cli_support.PRIVACY_SCOPE


def test_a_run_with_an_infinite_epsilon_writes_strict_json(tmp_path, capsys):
    """The non-private reference's report has ε = inf: null in the file, which strict parsers accept."""
    out = tmp_path / "m.json"
    assert main(["meta", "--algorithm", "nonprivate", "--n-tasks", "30", "--n-test-tasks", "10", "--learner", "ridge",
                 "--dim", "3", "--seed", "1", "--no-progress", "--out", str(out)]) == 0
    res = _strict(out.read_text())
    assert res["privacy"]["epsilon"] is None and res["epsilon_target"] is None
    printed = capsys.readouterr().out
    assert "privacy: NONE" in printed and "{" not in printed  # a summary, not a JSON dump


def test_seqrec_budget_stops_at_an_epoch_boundary():
    from jdp.seqrec.train import budget_says_stop
    steps = [5.0, 1.0, 1.0, 1.0]  # the first step compiles: not in the estimate
    assert not budget_says_stop(10.0, 4, 4, steps, budget_s=14.5)    # the next epoch (4 s) ends at 14 s: go on
    assert budget_says_stop(10.0, 4, 4, steps, budget_s=13.5)        # it would end past the budget: stop here
    assert not budget_says_stop(11.0, 5, 4, steps + [1.0], budget_s=13.5)  # mid-epoch: not yet
    assert budget_says_stop(13.6, 7, 4, steps + [1.0] * 3, budget_s=13.5)  # the budget is spent (estimate wrong)


@pytest.mark.slow
def test_seqrec_max_minutes_checkpoints_reports_the_steps_that_ran_and_resumes(tmp_path, capsys):
    """--max-minutes needs --checkpoint (refused before any work); a run out of time stops, writes the
    checkpoint, says where it stopped, and its privacy report covers the steps that ran, not the plan; --resume
    finishes it with the planned ε. NDCG / HIT are printed in percent only."""
    args = ["seqrec", "--data", "synthetic", "--model", "gru", "--epsilon", "8", "--epochs", "0.25", "--maxlen", "8",
            "--d", "8", "--batch-size", "250", "--no-progress", "--seed", "1"]
    assert main(args + ["--max-minutes", "1"]) == 2
    assert "--checkpoint" in capsys.readouterr().err
    assert main(args + ["--max-minutes", "0", "--checkpoint", str(tmp_path / "c")]) == 2
    out, ck = tmp_path / "r.json", tmp_path / "run.ckpt"
    assert main(args + ["--max-minutes", "1e-6", "--checkpoint", str(ck), "--out", str(out)]) == 0
    res = _strict(out.read_text())
    stopped = res["timings"]["stopped"]
    assert ck.exists() and stopped["step"] == 1 and stopped["planned_steps"] == res["steps"] == 2
    assert stopped["reason"] == "time budget" and stopped["checkpoint"] == str(ck)
    dp_sgd = [r for r in res["privacy"]["releases"] if r["name"].startswith("DP-SGD")]
    assert [r["count"] for r in dp_sgd] == [1] and res["privacy"]["epsilon"] < 8.0 - 1e-3
    printed = capsys.readouterr().out
    assert "STOPPED by --max-minutes" in printed and "--resume" in printed and "step 1 of 2" in printed
    test_line = next(line for line in printed.splitlines() if line.startswith("test NDCG@10"))
    assert test_line.count("%") == 4 and f"{100 * res['metrics']['ndcg_at_10_test']:.2f}%" in test_line
    assert res["metric_units"].startswith("NDCG@10 and HIT@10 are fractions")
    assert main(args + ["--checkpoint", str(ck), "--resume", "--out", str(out)]) == 0
    done = _strict(out.read_text())
    assert done["timings"]["complete"] and "stopped" not in done["timings"]
    assert done["privacy"]["epsilon"] == pytest.approx(8.0, rel=1e-3)
