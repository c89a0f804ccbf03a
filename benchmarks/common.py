"""Shared benchmark plumbing: provenance (command, commit, device, versions) and result files.

Each capability is a folder (benchmarks/<capability>/) holding its scripts, its results/ and its README.md; a script
writes into its own folder's results/ (`results_dir(__file__)`, which `write_results` finds from its caller)."""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import re
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def results_dir(module_file: str | os.PathLike) -> pathlib.Path:
    """benchmarks/<capability>/results for a script at benchmarks/<capability>/<script>.py."""
    return pathlib.Path(module_file).resolve().parent / "results"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=pathlib.Path(__file__).resolve().parent, check=True)
        # result files themselves do not make the code dirty (a benchmark rewrites its JSON as it goes)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":/",
                                ":(exclude,glob,top)benchmarks/**/results/**"], capture_output=True,
                               text=True, cwd=pathlib.Path(__file__).resolve().parent).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_description() -> str:
    import jax
    devs = jax.devices()
    kind = devs[0].device_kind if devs else "none"
    cpu = platform.processor() or platform.machine()
    return f"{jax.default_backend()}:{kind} x{len(devs)} (host {cpu}, {os.cpu_count()} cores)"


def versions() -> dict:
    import importlib.metadata as md
    out = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "optax", "dp-accounting", "numpy", "scipy", "jdp"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def _default_command() -> str:
    """`python -m benchmarks.x args` (relative, never an absolute path of this machine)."""
    script = pathlib.Path(sys.argv[0])
    root = pathlib.Path(__file__).resolve().parents[1]
    try:
        rel = script.resolve().relative_to(root).with_suffix("")
        head = "python -m " + ".".join(rel.parts)
    except ValueError:
        head = "python " + script.name
    return " ".join([head] + [_public_arg(a) for a in sys.argv[1:]])


def _public_arg(arg: str) -> str:
    """An absolute path argument (or --opt=/abs/path) as <its last component>: results never name this machine's
    folders."""
    opt, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    if os.path.isabs(value):
        value = f"<{pathlib.PurePath(value).name}>"
    return opt + eq + value


def provenance(command: str | None = None) -> dict:
    return {
        "command": command or _default_command(),
        "git_commit": git_commit(),
        "device": device_description(),
        "versions": versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_results(name: str, results: list[dict], command: str | None = None, directory: pathlib.Path | None = None,
                  **extra) -> pathlib.Path:
    """Writes <directory>/<name>.json = provenance + extra + {"results": rows}; the directory defaults to the calling
    script's results/ (benchmarks/<capability>/results)."""
    if directory is None:
        directory = results_dir(sys._getframe(1).f_globals["__file__"])
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    payload = {**provenance(command), **extra, "results": results}
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    return path


# Scripts before the folder per capability (benchmarks/<old>.py -> benchmarks/<capability>/<new>.py). Result files keep
# the command they were run with (history); pages that quote one show it under today's name (`current_names`).
RENAMED = {
    "accounting_calibration": "privacy.calibration", "privacy_audit": "privacy.audit",
    "altmin_gram_cores": "altmin.gram_cores", "altmin_quality": "altmin.quality", "altmin_section": "altmin.section",
    "altmin_solver": "altmin.solver", "altmin_speed": "altmin.speed", "cli_first_run": "cli.first_run",
    "clipping_bench": "clipping.bench", "clipping_external": "clipping.external",
    "clipping_precision": "clipping.precision", "clipping_rnn": "clipping.rnn",
    "clipping_sharding": "clipping.sharding", "data_generation": "data.generation",
    "meta_experiments": "meta.experiments", "meta_section": "meta.section", "selection_bandit": "selection.bandit",
    "selection_recommendation": "selection.recommendation", "selection_section": "selection.section",
    "selection_speed": "selection.speed", "selection_synthetic": "selection.synthetic",
    "seqrec_baselines": "seqrec.baselines", "seqrec_candidates": "seqrec.candidates",
    "seqrec_grad_snr": "seqrec.grad_snr",
    "seqrec_partial_noise": "seqrec.partial_noise", "seqrec_repro": "seqrec.repro", "seqrec_speed": "seqrec.speed",
    "seqrec_table2": "seqrec.table2", "seqrec_table_diagnostics": "seqrec.table_diagnostics",
    "seqrec_transitions": "seqrec.transitions",
}
# a result file's capability from its name's prefix (for paths recorded as benchmarks/results/<name>)
_RESULT_PREFIXES = (("accounting_", "privacy"), ("privacy_", "privacy"), ("altmin_", "altmin"), ("cli_", "cli"),
                    ("clipping", "clipping"), ("data_", "data"), ("meta_", "meta"), ("selection_", "selection"),
                    ("seqrec_", "seqrec"))
_OLD_MODULE = re.compile(r"benchmarks([./])(" + "|".join(sorted(RENAMED, key=len, reverse=True)) + r")(?![\w])")
_OLD_RESULT = re.compile(r"benchmarks/results/([\w*][\w*.\-<>{}]*)")


def _capability_of(result_name: str) -> str:
    return next((cap for prefix, cap in _RESULT_PREFIXES if result_name.startswith(prefix)), "")


def current_names(text: str) -> str:
    """`text` with the scripts' and result files' names from before the folder per capability replaced by today's
    (`python -m benchmarks.seqrec_speed` -> `python -m benchmarks.seqrec.speed`)."""
    text = _OLD_MODULE.sub(lambda m: "benchmarks" + m[1] + RENAMED[m[2]].replace(".", m[1]), text)
    return _OLD_RESULT.sub(lambda m: (f"benchmarks/{_capability_of(m[1])}/results/{m[1]}" if _capability_of(m[1])
                                      else m[0]), text)


NAV = "[All benchmarks](../README.md) · [notes: what was tried](NOTES.md)\n\n"


def with_nav(page: str) -> str:
    """A capability page (benchmarks/<capability>/README.md) with the line that links the summary and its notes."""
    return page if page.startswith(NAV) else NAV + page
