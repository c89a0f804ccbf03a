"""What every `jdp` command shares: seed and data arguments, the one output style (strict JSON in --out, a short
summary with the privacy report on stdout), outputs checked before any work, flags named in errors, help that shows
defaults. The package CLIs (`jdp/*/cli.py`) import it; the dispatcher `jdp.cli` imports them (one direction)."""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import pathlib
import re
import sys
import tempfile
import warnings
from typing import Any

from jdp.noise import resolve_seed


SEED_HELP = ("seed of the privacy noise (default: fresh OS entropy, printed and written to the JSON output). "
             "A fixed seed reproduces an experiment; never release a result whose seed others know.")


# every command's result JSON says what its ε covers: the rest of the file is evaluation on the data
PRIVACY_SCOPE = ("epsilon covers the releases listed under 'privacy' and what is computed from them only. The "
                 "metrics, baselines, losses, warnings and timings in this file are computed from the data without "
                 "noise (evaluation, not releases): share them only where that data may be seen. The seed "
                 "regenerates the privacy noise: keep it secret.")


def json_safe(value: Any) -> Any:
    """`value` as plain JSON data: every non-finite float (NaN, +-inf) becomes None (JSON null), numpy / JAX
    scalars and arrays become Python numbers and lists, tuples become lists. Strict parsers (JavaScript's
    JSON.parse, `json.loads(..., parse_constant=...)`) reject the `NaN` / `Infinity` tokens Python would write."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (str, bool, int)) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "tolist"):  # numpy / JAX arrays and scalars
        return json_safe(value.tolist())
    try:
        return json_safe(float(value))
    except (TypeError, ValueError):
        return str(value)


def to_json(payload: Any) -> str:
    """Strict JSON text of `payload` (`json_safe`: NaN / inf written as null; never the `NaN` / `Infinity` tokens)."""
    return json.dumps(json_safe(payload), indent=2, allow_nan=False)


def result_json(payload: dict, default=None) -> str:
    """The JSON text of a command's result, with `privacy_scope` (`PRIVACY_SCOPE`) beside the payload. Strict
    JSON (`to_json`): a non-finite number (an undefined metric, an infinite epsilon) is written as null.
    `default` is accepted for compatibility and ignored."""
    return to_json({**payload, "privacy_scope": PRIVACY_SCOPE})


def write_result(path, payload: dict) -> str:
    """Writes the result JSON (`result_json`) to `path`; returns the line a command prints about it."""
    replaced = pathlib.Path(path).exists()
    pathlib.Path(path).write_text(result_json(payload) + "\n")
    return f"wrote {path} (the full result as JSON{'; it replaced the file that was there' if replaced else ''})"


def privacy_lines(privacy: dict | None) -> list[str]:
    """The printed privacy report of a command, from `PrivacyReport.to_dict()` (the layout of
    `str(PrivacyReport)`): unit and relation, one line per release, the total epsilon, the assumptions."""
    if not privacy or privacy.get("non_private"):
        return ["privacy: NONE (the non-private reference: no noise, no guarantee)"]
    lines = [f"PrivacyReport: unit={privacy.get('unit')} ({privacy.get('relation_text', '')}), "
             f"delta={privacy.get('delta'):g}"]
    for r in privacy.get("releases") or []:
        sens = "-" if r.get("sensitivity") is None else f"{r['sensitivity']:.4g}"
        noise = "-" if r.get("noise_scale") is None else f"{r['noise_scale']:.4g}"
        kind = str(r.get("event", "")).split("(", 1)[0]
        lines.append(f"  {r['name']:<32} x{r.get('count', 1):<4} sens={sens:<10} noise={noise:<10} {kind}")
    eps = privacy.get("epsilon")
    lines.append("  total epsilon = " + ("not finite" if eps is None or not math.isfinite(eps) else f"{eps:.4f}"))
    lines += [f"  WARNING: {w}" for w in privacy.get("warnings") or []]  # e.g. epsilon above LARGE_EPSILON
    for rel, e in (privacy.get("epsilon_by_relation") or {}).items():
        lines.append(f"  epsilon under {rel}: " + ("not defined" if e is None else f"{e:.4f}"))
    lines += [f"  assumes: {a}" for a in privacy.get("assumptions") or []]
    return lines


def no_out_hint(args: argparse.Namespace) -> list[str]:
    """The closing line of a summary without `--out`: where the full result would go."""
    return [] if getattr(args, "out", None) else ["(--out FILE writes the full result as JSON)"]


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
    with flag_names({"seed": "--seed"}):
        seed = resolve_seed(args.seed)
    origin = "fresh OS entropy" if args.seed is None else "from --seed"
    print(f"noise seed {seed} ({origin}); `--seed {seed}` reproduces this run. Keep it secret: it regenerates "
          "the privacy noise.", file=sys.stderr)
    return seed


def _shows_default(action: argparse.Action) -> bool:
    return bool(action.option_strings) and action.default not in (None, False, argparse.SUPPRESS) \
        and action.help is not argparse.SUPPRESS


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, "(default: ...)", unless it has none (None / a flag) or
    its text already states it; options without a help text get one that gives the default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = (action.help or "").strip()
        if _shows_default(action) and "%(default)" not in text and "(default" not in text:
            text = f"{text} (default: %(default)s)" if text else "(default: %(default)s)"
        return text

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and _shows_default(action):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


class RawDescriptionHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`HelpFormatter` keeping the description's own line breaks (module docstrings with examples)."""


def use_default_showing_help(parser: argparse.ArgumentParser) -> None:
    """Gives `parser` and every subcommand parser under it `HelpFormatter` (keeping a raw description raw)."""
    raw = issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter)
    parser.formatter_class = RawDescriptionHelpFormatter if raw else HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in set(action.choices.values()):
                use_default_showing_help(child)


class DeprecatedFlag(argparse.Action):
    """A flag renamed in this release (`add_deprecated_flag`): stores its value under the new flag's name and
    prints a deprecation note on stderr."""

    def __init__(self, option_strings, dest, new_flag: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.new_flag = new_flag

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"note: {option_string} is deprecated and will be removed in the next release; use {self.new_flag}",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_deprecated_flag(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """`old`, the name of the flag `new` (already added) before this release: still accepted for one release, not
    shown in --help, with a deprecation note on stderr."""
    action = next(a for a in parser._actions if new in a.option_strings)
    parser.add_argument(old, dest=action.dest, type=action.type, metavar=action.metavar, action=DeprecatedFlag,
                        new_flag=new, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def deepest_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command `args` ran, e.g. `jdp select run`'s: its usage line names the command."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if not subs or name not in subs[0].choices:
            return parser
        parser = subs[0].choices[name]


def move_to_group(parser: argparse.ArgumentParser, title: str, dests: list[str]) -> None:
    """Shows the options `dests` (already added to `parser`) under the help heading `title` (created if new)."""
    group = next((g for g in parser._action_groups if g.title == title), None) or parser.add_argument_group(title)
    for action in list(parser._actions):
        if action.dest in dests:
            for g in parser._action_groups:
                if action in g._group_actions and g is not group:
                    g._group_actions.remove(action)
            if action not in group._group_actions:
                group._group_actions.append(action)


def named_by_flag(message: str, flags: dict[str, str]) -> str:
    """`message` (a library's refusal) with each argument name in `flags` replaced by the command-line flag that
    sets it, where the message states a rule about it ("epochs must ...", "delta = 0.5 >= 1/n", "steps >= 1"):
    a user of the command reads `--epochs`, not the Python name. Prose around it is left as it is."""
    for name, flag in flags.items():
        message = re.sub(rf"(?<![\w-]){re.escape(name)}(?= (?:must|=|>=|<=|>|<|is above)(?:\s|$))", flag, message)
    return message


@contextlib.contextmanager
def flag_names(flags: dict[str, str]):
    """Re-raises a ValueError raised inside with its message `named_by_flag(message, flags)` (no traceback
    of the library is shown by `main` anyway: the message is what the user reads)."""
    try:
        yield
    except ValueError as err:
        renamed = named_by_flag(str(err), flags)
        if renamed == str(err):
            raise
        raise ValueError(renamed) from err


def check_flag_privacy(epsilon: float | None, delta: float, num_units: int | None, unit: str) -> None:
    """The one privacy rule (`jdp.validation.check_privacy`) on the flags `--epsilon` / `--delta`, called by a
    command before any work (reading data, drawing a seed). Refusals name the flags; the warnings (ε above
    `LARGE_EPSILON`, δ above 1/(10 n)) are left to the library's own call, so that each is printed once."""
    from jdp.validation import check_privacy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        check_privacy(epsilon, delta, num_units, unit=unit, epsilon_name="--epsilon", delta_name="--delta")


def check_at_least(args: argparse.Namespace, minimums: dict[str, int]) -> None:
    """Refuses, before any work, an integer option below its minimum (`minimums`: dest -> smallest value; None
    values are the option's default and pass), naming the flag."""
    for dest, low in minimums.items():
        value = getattr(args, dest, None)
        if value is not None and value < low:
            raise ValueError(f"--{dest.replace('_', '-')} must be >= {low}, got {value}")


IMAGE_SUFFIXES_HINT = ".png, .pdf or .svg"


def check_output_path(path, flag: str) -> pathlib.Path:
    """Refuses, before any work, an output file that could not be written: a folder, a missing folder, a
    folder or file without write permission. Creates nothing (a probe file is made and removed)."""
    p = pathlib.Path(path)
    if p.is_dir():
        raise ValueError(f"{flag}: {path} is a directory; give a file name in it, e.g. {p / 'run.json'}")
    folder = p.parent
    if not folder.is_dir():
        raise ValueError(f"{flag}: the directory {folder} does not exist (nothing was run): create it first "
                         f"(mkdir -p {folder}) or choose another path")
    try:
        if p.exists():
            with open(p, "a"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".jdp-write-check-"):
                pass
    except OSError as err:
        raise ValueError(f"{flag}: cannot write {path} ({err.strerror or err}); nothing was run: choose a "
                         "writable location") from None
    return p


def check_plot_path(path, flag: str = "--plot") -> None:
    """Refuses, before any work, a plot that could not be drawn: no matplotlib, or a file suffix matplotlib
    cannot write (a missing suffix would make it append one: the file would not be the one asked for)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(f"{flag} needs matplotlib, which is not installed (nothing was run): pip install matplotlib "
                         "(in a checkout: pip install -e '.[plots]'), or leave out --plot") from None
    from matplotlib.backend_bases import FigureCanvasBase
    suffix = pathlib.Path(path).suffix.lower().lstrip(".")
    supported = FigureCanvasBase.get_supported_filetypes()
    if suffix not in supported:
        raise ValueError(f"{flag}: {path} has {'no suffix' if not suffix else f'the suffix .{suffix}'}, not an image "
                         f"format matplotlib writes; use {IMAGE_SUFFIXES_HINT} (or {', '.join(sorted(supported))})")


OUTPUT_ARGUMENTS = {"out": "--out", "plot": "--plot", "checkpoint": "--checkpoint"}


def check_outputs(args: argparse.Namespace) -> None:
    """Every output file a command was given (`OUTPUT_ARGUMENTS`) can be written, and a `--plot` drawn: checked
    before any work, so that a run is never lost to a typo in a path."""
    for dest, flag in OUTPUT_ARGUMENTS.items():
        if getattr(args, dest, None):
            check_output_path(getattr(args, dest), flag)
    if getattr(args, "plot", None):
        check_plot_path(args.plot)
