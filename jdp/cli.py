"""The `jdp` command. Each capability registers its own subcommand from `<package>/cli.py`."""
from __future__ import annotations

import argparse
import atexit
import importlib
import importlib.util
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


from jdp.cli_support import check_outputs, deepest_parser, flag_names, use_default_showing_help


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given the command line `argv`, only the subcommand it names is imported (each imports its
    whole package: flax, the clipping engine, ... — a second of start-up for the others), else all of them.
    Every help shows the options' defaults (`HelpFormatter`)."""
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
    use_default_showing_help(parser)
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


BROKEN_PIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for `yes | head -1`'s writer


def _quiet_broken_pipe() -> int:
    """The reader of stdout went away (`jdp ... | head`): like a Unix tool, stop quietly. Stdout is pointed at
    /dev/null so that flushing what is still buffered cannot fail again at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return BROKEN_PIPE_EXIT


def main(argv: list[str] | None = None) -> int:
    """Runs one `jdp` command; returns its exit status (2: invalid input, refused with a message; 141: the
    reader of the output went away, e.g. `| head`)."""
    try:
        return _main(argv)
    except BrokenPipeError:
        return _quiet_broken_pipe()


def _main(argv: list[str] | None) -> int:
    reuse_freed_memory_if_requested()  # opt-in (jdp.hostmem), before JAX starts its threads
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the command's own parser: its usage line names the command (`usage: jdp altmin ...`)
        deepest_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        check_outputs(args)  # before any work
        if getattr(args, "seed", None) is not None:  # a --seed out of range, refused before any work
            with flag_names({"seed": "--seed"}):
                resolve_seed(args.seed)
        enable_compilation_cache()
        result = args.func(args)
    except BrokenPipeError:
        raise
    except (ValueError, OSError) as err:  # invalid user input or a missing/unreadable file: no traceback
        print(f"{deepest_parser(parser, args).prog}: error: {err}", file=sys.stderr)  # e.g. `jdp select run: error:`
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
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:  # what was still buffered has no reader any more (`| head`): exit quietly
            code = _quiet_broken_pipe() if stream is sys.stdout else code
        except (OSError, ValueError):
            pass
    os._exit(code)


def entry_point() -> NoReturn:
    """The `jdp` console command: `main` on sys.argv, then `exit_fast` (an exception still exits the usual way,
    with its traceback). argparse's exits (--help, --version, usage errors) end through `exit_fast` too, so that
    their output meeting a closed pipe (`jdp seqrec --help | head -3`) ends quietly as well."""
    try:
        code = main()
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    exit_fast(code)


if __name__ == "__main__":
    entry_point()
