"""The `jdp` command. Each capability registers its own subcommand from `<package>/cli.py`."""
from __future__ import annotations

import argparse
import atexit
import importlib
import importlib.util
import json
import os
import pathlib
import sys
import threading
from typing import NoReturn

import jdp
from jdp.hostmem import reuse_freed_memory_if_requested
from jdp.noise import resolve_seed

# subcommand -> module providing `register(subparsers)`; modules are imported only when present.
SUBCOMMANDS = {
    "demo": "jdp.demo",
    "altmin": "jdp.altmin.cli",
    "seqrec": "jdp.seqrec.cli",
    "select": "jdp.selection.cli",
    "meta": "jdp.meta.cli",
}


SEED_HELP = ("seed of the privacy noise (default: fresh OS entropy, printed and written to the JSON output). "
             "A fixed seed reproduces an experiment; never release a result whose seed others know.")


# every command's result JSON says what its ε covers: the rest of the file is evaluation on the data
PRIVACY_SCOPE = ("epsilon covers the releases listed under 'privacy' and what is computed from them only. The "
                 "metrics, baselines, losses, warnings and timings in this file are computed from the data without "
                 "noise (evaluation, not releases): share them only where that data may be seen. The seed "
                 "regenerates the privacy noise: keep it secret.")


def result_json(payload: dict, default=float) -> str:
    """The JSON text of a command's result, with `privacy_scope` (`PRIVACY_SCOPE`) beside the payload."""
    return json.dumps({**payload, "privacy_scope": PRIVACY_SCOPE}, indent=2, default=default)


def add_seed_arguments(parser: argparse.ArgumentParser, data_seed: bool = True) -> None:
    """`--seed` (privacy noise, default fresh OS entropy) and `--data-seed` (synthetic data and splits:
    public randomness, default 0 so experiments stay comparable)."""
    parser.add_argument("--seed", type=int, default=None, help=SEED_HELP)
    if data_seed:
        parser.add_argument("--data-seed", type=int, default=0,
                            help="seed of synthetic data generation and of data splits (not of any noise)")


def add_data_dir_arguments(parser: argparse.ArgumentParser) -> None:
    """`--data-dir` (download cache) and `--data-sha256` for the datasets `jdp.data.fetch` downloads."""
    parser.add_argument("--data-dir", default=None,
                        help="cache directory of downloaded datasets (default: $JDP_DATA, else ~/.cache/jdp). "
                             "A named dataset is downloaded there on first use, SHA-256-checked, and read from "
                             "there afterwards without network access; --data-path bypasses it")
    parser.add_argument("--data-sha256", default=None,
                        help="expected SHA-256 of the downloaded file, for a dataset with no published hash "
                             "(ml-10m)")


def noise_seed(args: argparse.Namespace) -> int:
    """The run's noise seed (fresh OS entropy unless --seed was given), announced on stderr."""
    seed = resolve_seed(args.seed)
    origin = "fresh OS entropy" if args.seed is None else "from --seed"
    print(f"noise seed {seed} ({origin}); `--seed {seed}` reproduces this run. Keep it secret: it regenerates "
          "the privacy noise.", file=sys.stderr)
    return seed


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given the command line `argv`, only the subcommand it names is imported (each imports its
    whole package: flax, the clipping engine, ... — a second of start-up for the others), else all of them."""
    parser = argparse.ArgumentParser(prog="jdp", description="Differentially private learning on long-tailed data.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {jdp.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    named = [a for a in (argv or []) if not a.startswith("-")][:1]
    for command, module_name in SUBCOMMANDS.items():
        if named and named[0] in SUBCOMMANDS and command != named[0]:
            continue
        try:
            found = importlib.util.find_spec(module_name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            importlib.import_module(module_name).register(sub)
    return parser


def enable_compilation_cache() -> str | None:
    """Turns on JAX's persistent compilation cache for CLI runs, so a command compiles each program once
    per shape and machine, not once per run: `JDP_COMPILATION_CACHE` (a directory; "off" disables), default
    `<JDP_DATA or ~/.cache/jdp>/xla`. Compiled programs hold no data. Returns the directory used (None: off)."""
    import jax
    if jax.config.jax_compilation_cache_dir:  # the caller configured one: keep it
        return jax.config.jax_compilation_cache_dir
    path = os.environ.get("JDP_COMPILATION_CACHE")
    if path is None:
        path = str(pathlib.Path(os.environ.get("JDP_DATA") or pathlib.Path.home() / ".cache" / "jdp") / "xla")
    if path.lower() in ("", "0", "off", "none"):
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    return path


def main(argv: list[str] | None = None) -> int:
    reuse_freed_memory_if_requested()  # opt-in (jdp.hostmem), before JAX starts its threads
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    enable_compilation_cache()
    try:
        result = args.func(args)
    except (ValueError, OSError) as err:  # invalid user input or a missing/unreadable file: no traceback
        print(f"jdp {args.command}: error: {err}", file=sys.stderr)
        return 2
    return int(result or 0)


def exit_fast(code: int) -> NoReturn:
    """Ends the process once a command has returned, without the interpreter's teardown (which frees every module
    and XLA's compiled programs one by one: 0.55-0.65 s after a 10 s `jdp seqrec --data synthetic` on a 2-core
    CPU, while the results are already printed). What a normal exit does that matters still happens: other
    threads are joined, the atexit handlers run (JAX's clean-up and distributed shutdown, logging's flush) and
    the standard streams are flushed; every file a command writes is closed when it returns."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def entry_point() -> NoReturn:
    """The `jdp` console command: `main` on sys.argv, then `exit_fast` (an exception still exits the usual way,
    with its traceback)."""
    exit_fast(main())


if __name__ == "__main__":
    entry_point()
