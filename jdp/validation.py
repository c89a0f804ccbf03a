"""Input validation shared by every routine: privacy parameters (ε, δ), positive scalars, (0, 1) values, and
the selection mechanisms' score / sensitivity arrays (host side; skipped for traced values under jit).

Each check raises a ValueError naming the argument and returns the validated value."""
from __future__ import annotations

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


def check_delta(delta: float, name: str = "delta", num_units: int | None = None) -> float:
    """Returns delta as float; raises ValueError unless 0 < delta < 1.

    With `num_units` (the number of protected units: examples, users, tasks) also refuses
    delta >= 1/num_units — publishing one random unit's data in the clear is (0, 1/n)-DP, so such a
    guarantee means nothing — and warns above 1/(10 num_units)."""
    try:
        value = float(delta)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be in (0, 1), got {delta!r}") from None
    if not (0.0 < value < 1.0):
        raise ValueError(f"{name} must be in (0, 1), got {delta!r}")
    if num_units is not None and int(num_units) >= 1:
        n = int(num_units)
        if value >= 1.0 / n:
            raise ValueError(f"{name} = {value:.3g} >= 1/n = {1.0 / n:.3g} for n = {n} protected units: a "
                             f"mechanism that publishes one random unit's data in the clear meets that "
                             f"guarantee. Use {name} well below 1/n (e.g. <= {0.1 / n:.2g}).")
        if value > 0.1 / n:
            # one place and one registry for every caller: a run that checks the same δ in several layers
            # (a trainer, then its DP-SGD transformation) prints the warning once
            warnings.warn_explicit(f"{name} = {value:.3g} is above 1/(10 n) = {0.1 / n:.3g} for n = {n} protected "
                                   f"units; the usual choice is {name} << 1/n", UserWarning, __file__, 0,
                                   module=__name__, registry=_DELTA_WARNINGS)
    return value


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
