"""Shared benchmark plumbing: provenance (command, commit, device, versions) and result files."""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=pathlib.Path(__file__).resolve().parent, check=True)
        # result files themselves do not make the code dirty (a benchmark rewrites its JSON as it goes)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":/",
                                ":(exclude,top)benchmarks/results"], capture_output=True,
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


def write_results(name: str, results: list[dict], command: str | None = None, **extra) -> pathlib.Path:
    """Writes benchmarks/results/<name>.json = provenance + extra + {"results": rows}."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {**provenance(command), **extra, "results": results}
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    return path
