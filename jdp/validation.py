"""Input validation shared by every routine: privacy parameters (ε, δ; `check_privacy` is the one rule of every
private entry point), positive scalars, (0, 1) values, the selection mechanisms' score / sensitivity arrays
(host side; skipped for traced values under jit), and keywords renamed in this release (`renamed_keywords`).

Each check raises a ValueError naming the argument and returns the validated value."""
from __future__ import annotations

import functools
import math
import warnings

import jax
import numpy as np


def check_epsilon(epsilon: float, name: str = "epsilon", allow_inf: bool = False) -> float:
    """Returns epsilon as float; raises ValueError unless 0 < epsilon (< inf unless allowed)."""
    try:
        value = float(epsilon)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number, got {epsilon!r}") from None
    if math.isnan(value) or value <= 0 or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be a positive finite number, got {epsilon!r}")
    return value


_DELTA_WARNINGS: dict = {}


def check_delta(delta: float, name: str = "delta", num_units: int | None = None, unit: str = "unit") -> float:
    """Returns delta as float; raises ValueError unless 0 < delta < 1.

    With `num_units` (the declared public number of protected units: examples, users, tasks) also refuses
    delta >= 1/num_units — publishing one random unit's data in the clear is (0, 1/n)-DP, so such a
    guarantee means nothing — and warns above 1/(10 num_units). Entry points call `check_privacy`."""
    try:
        value = float(delta)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be in (0, 1), got {delta!r}") from None
    if not (0.0 < value < 1.0):
        raise ValueError(f"{name} must be in (0, 1), got {delta!r}")
    if num_units is not None:
        try:
            n = int(num_units)
        except (TypeError, ValueError):
            raise ValueError(f"the number of protected {unit}s must be a positive integer, got {num_units!r}") from None
        if n < 1:
            raise ValueError(f"the number of protected {unit}s must be >= 1, got {num_units!r}")
        if value >= 1.0 / n:
            raise ValueError(f"{name} = {value:.3g} >= 1/n = {1.0 / n:.3g} for n = {n} protected {unit}s: a "
                             f"mechanism that publishes one random {unit}'s data in the clear meets that "
                             f"guarantee. Use {name} well below 1/n (e.g. <= {0.1 / n:.2g}).")
        if value > 0.1 / n:
            # one place and one registry for every caller: a run that checks the same δ in several layers
            # (a trainer, then its DP-SGD transformation) prints the warning once
            warnings.warn_explicit(f"{name} = {value:.3g} is above 1/(10 n) = {0.1 / n:.3g} for n = {n} protected "
                                   f"{unit}s; the usual choice is {name} << 1/n", UserWarning, __file__, 0,
                                   module=__name__, registry=_DELTA_WARNINGS)
    return value


# The one rule for the privacy parameters of every private entry point (`check_privacy`).
LARGE_EPSILON = 30.0
"""Targets above this are accepted but warned (no deployed release that calls itself private spends more; at such
an ε the noise hides almost nothing), and every report whose composed ε exceeds it carries a warning."""
MAX_EPSILON = 1e3
"""Targets above this are refused before any work: nothing is left to protect (a ε-DP mechanism may change an
event's odds by e^ε) and calibrating the noise for such a target only finds the smallest noise of its search."""


def large_epsilon_warning(epsilon: float, unit: str = "unit") -> str | None:
    """The warning a run or report states for an ε above `LARGE_EPSILON` (None at or below it, and for ε = ∞: a
    non-private reference says so itself)."""
    try:
        value = float(epsilon)
    except (TypeError, ValueError):
        return None
    if not (LARGE_EPSILON < value < math.inf):
        return None
    return (f"epsilon = {value:.4g} is above {LARGE_EPSILON:g}: a guarantee this weak lets an observer tell whether "
            f"one {unit} took part with odds up to e^{value:.3g}; treat the result as (almost) non-private")


def check_epsilon_target(epsilon: float, epsilon_name: str = "epsilon", unit: str = "unit") -> float:
    """ε as float: finite, > 0 and at most `MAX_EPSILON` (ValueError naming the argument); above `LARGE_EPSILON`
    accepted with a UserWarning. The ε half of `check_privacy`, for mechanisms that have no δ (pure DP)."""
    epsilon = check_epsilon(epsilon, epsilon_name)
    if epsilon > MAX_EPSILON:
        raise ValueError(f"{epsilon_name} = {epsilon:.4g} is above the largest target jdp calibrates for, "
                         f"{MAX_EPSILON:g}: at such an epsilon nothing is protected (an observer may tell whether one "
                         f"{unit} took part with odds up to e^{epsilon:.3g}) and the calibration could only return the "
                         f"smallest noise it searches. Give {epsilon_name} <= {LARGE_EPSILON:g} for a meaningful "
                         f"guarantee, or run the non-private reference.")
    note = large_epsilon_warning(epsilon, unit)
    if note is not None:
        # the same text from every layer (a CLI's flag, then the library): printed once
        warnings.warn_explicit(note, UserWarning, __file__, 0, module=__name__, registry=_EPSILON_WARNINGS)
    return epsilon


def check_privacy(epsilon: float | None, delta: float, num_units: int | None, *, unit: str = "unit",
                  epsilon_name: str = "epsilon", delta_name: str = "delta") -> tuple[float | None, float]:
    """The one rule for a private entry point's privacy parameters; returns (ε as float or None, δ as float).

    - ε (None: the caller gives a noise scale instead and nothing is checked): finite, > 0 and at most
      `MAX_EPSILON` (refused: ValueError naming the argument); above `LARGE_EPSILON` accepted with a
      UserWarning (reports above it carry the same warning, `PrivacyReport.to_dict`).
    - δ: in (0, 1) and, with `num_units` = n the DECLARED PUBLIC number of privacy units (examples for
      example-level, users for user-level, tasks for task-level DP), below 1/n: publishing one random unit's data
      in the clear is (0, 1/n)-DP (`check_delta`).

    Every library entry point calls it before any work; the CLIs get the rule by calling the library (or this
    function with their flags' names)."""
    delta = check_delta(delta, delta_name, num_units=num_units, unit=unit)
    if epsilon is None:
        return None, delta
    epsilon = check_epsilon_target(epsilon, epsilon_name, unit)
    return epsilon, delta


_EPSILON_WARNINGS: dict = {}


def check_positive(value: float, name: str, allow_zero: bool = False) -> float:
    """Returns value as float; raises ValueError unless finite and > 0 (or >= 0)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a finite number, got {value!r}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value!r}")
    return v


def is_concrete(*xs) -> bool:
    """True when no argument is a jax Tracer (i.e. values can be inspected on the host)."""
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def check_shapes(scores, sensitivities, name_scores: str = "scores", name_sens: str = "sensitivities") -> None:
    """Shape-only part of `check_scores` (no pass over the values)."""
    q_shape, d_shape = np.shape(scores), np.shape(sensitivities)
    if len(q_shape) == 0 or q_shape[-1] == 0 or 0 in q_shape:
        raise ValueError(f"{name_scores} must have at least one candidate on its last axis, got shape {q_shape}")
    if d_shape != q_shape and d_shape != q_shape[-1:]:
        raise ValueError(f"{name_sens} must have shape {q_shape[-1:]} or {q_shape}, got {d_shape}")


def check_scores(scores, sensitivities, name_scores: str = "scores",
                 name_sens: str = "sensitivities") -> None:
    """Raises ValueError unless scores [..., k] (k >= 1) and sensitivities ([k] or scores' shape) are
    finite, sensitivities > 0 and the shapes agree. No-op for traced arrays."""
    if not is_concrete(scores, sensitivities):
        return
    q = np.asarray(scores)
    d = np.asarray(sensitivities)
    if q.ndim == 0 or q.shape[-1] == 0 or q.size == 0:
        raise ValueError(f"{name_scores} must have at least one candidate on its last axis, got shape {q.shape}")
    if d.shape != q.shape and d.shape != q.shape[-1:]:
        raise ValueError(f"{name_sens} must have shape {q.shape[-1:]} or {q.shape}, got {d.shape}")
    if not np.all(np.isfinite(q)):
        raise ValueError(f"{name_scores} must be finite (no NaN/inf)")
    if not np.all(np.isfinite(d)):
        raise ValueError(f"{name_sens} must be finite (no NaN/inf)")
    if not np.all(d > 0):
        raise ValueError(f"{name_sens} must be > 0 (use a small public floor for constant scores)")


def check_eps(epsilon, name: str = "epsilon"):
    """Validated float epsilon, or the traced value unchanged."""
    if not is_concrete(epsilon):
        return epsilon
    if np.ndim(epsilon) > 0:
        e = np.asarray(epsilon, dtype=np.float64)
        if not np.all(np.isfinite(e)) or not np.all(e > 0):
            raise ValueError(f"{name} must be positive and finite, got {epsilon!r}")
        return epsilon
    return check_epsilon(epsilon, name)


def check_open_unit(value: float, name: str) -> float:
    """Returns value as float; raises ValueError unless 0 < value < 1."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be in (0, 1), got {value!r}") from None
    if not (0.0 < v < 1.0) or math.isnan(v):
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return v


def renamed_keywords(**renames: str):
    """Decorator for keywords renamed in this release, e.g. `@renamed_keywords(clip="l2_clip")`: the old keyword
    still works for one release, with a DeprecationWarning naming the new one; passing both is a ValueError. On a
    function it renames the call's keywords; on a (data)class those of its constructor, and reading the old
    attribute name also works, with the same warning."""
    def deprecated(where: str, old: str, new: str, stacklevel: int) -> None:  # stacklevel: the caller's frame
        warnings.warn(f"{where}: {old} is deprecated and will be removed in the next release; use {new}",
                      DeprecationWarning, stacklevel=stacklevel)

    def renamed(where: str, kwargs: dict) -> dict:
        for old, new in renames.items():
            if old in kwargs:
                if new in kwargs:
                    raise ValueError(f"{where}: {old}= is the deprecated name of {new}=; pass {new}= only")
                deprecated(where, f"{old}=", f"{new}=", 4)
                kwargs[new] = kwargs.pop(old)
        return kwargs

    def decorate(obj):
        if not isinstance(obj, type):
            @functools.wraps(obj)
            def call(*args, **kwargs):
                return obj(*args, **renamed(obj.__name__, kwargs))
            return call
        init = obj.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            init(self, *args, **renamed(obj.__name__, kwargs))

        def __getattr__(self, name: str):  # only reached when the normal lookup fails
            if name not in renames:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            deprecated(type(self).__name__, f".{name}", f".{renames[name]}", 3)
            return getattr(self, renames[name])

        obj.__init__, obj.__getattr__ = __init__, __getattr__
        return obj
    return decorate
