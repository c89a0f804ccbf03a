"""Private hyper-parameter selection for DP alternating minimization.

`tune_private(train, valid, configs, epsilon=..., delta=...)` fits every candidate configuration
privately, scores each on validation ratings with a per-user bounded loss and picks one with an
ε-DP selection mechanism (`jdp.selection.select_configuration`). Everything is in one PrivacyReport:
the K candidate runs (all of them touch every user's data) and the selection.

Unit of privacy: a user; neighbours add or remove all of one user's ratings, in train and valid.
Budget: a fraction `selection_fraction` of ε goes to the selection (pure ε_sel-DP); the K runs share
the rest, each at the same ε_run, calibrated with dp_accounting so that their composition spends
(ε - ε_sel, δ); by basic composition with the pure selection the total is ≤ (ε, δ), and the report
composes it exactly (usually a little less). The candidate grid must be public (fixed before seeing
the data), e.g. a small grid over dim, reg_scale, μ and steps.

Validation score of candidate c: q_c = -Σ_users min(mean squared error of the user's validation
ratings, B), each user's embedding solved from the released item matrix and the user's own training
ratings (billboard model). A user's term lies in [0, B] and enters every q_c with the same sign:
monotone scores of sensitivity B. Default B = ((hi - lo)/2)², the squared half-range (4 on 1–5 stars): a
user whose validation MSE exceeds it is truncated (the same for every candidate); a smaller B than the
worst case (hi - lo)² makes the choice 4× sharper at the same ε_sel.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import dp_accounting
import numpy as np

from jdp.accounting import ADD_OR_REMOVE_ONE, PrivacyReport, calibrate
from jdp.altmin.config import AltMinConfig
from jdp.altmin.plan import candidate_event
from jdp.altmin.train import AltMinModel, checked_config, fit
from jdp.data import Interactions, split_ratings_by_pair_hash
from jdp.noise import resolve_seed, seeded_key
from jdp.selection.tuning import select_configuration, selection_event
from jdp.validation import check_positive, check_privacy
from jdp.validation import check_open_unit

TUNE_SPLIT_SEED = 0  # fit_tuned without valid: the train/valid split (public randomness, never noise)
TUNE_VALID_FRACTION = 0.1  # fit_tuned without valid: each row goes to valid with this probability

@dataclasses.dataclass
class TunedModel:
    """The chosen model, its index in the grid and the report of the whole tuning (K runs + selection).

    `validation_scores` are private statistics used by the mechanism: never publish them."""
    model: AltMinModel
    index: int
    configs: tuple[AltMinConfig, ...]
    report: PrivacyReport
    run_epsilon: float
    validation_scores: np.ndarray
    seed: int


def user_validation_losses(model: AltMinModel, train: Interactions, valid: Interactions) -> np.ndarray:
    """Each user's mean squared error on their validation ratings [n_users] (0 for users without any)."""
    users = model.user_factors(train)
    err = (model.predict(users, valid.user, valid.item) - valid.rating) ** 2
    n = np.bincount(valid.user, minlength=valid.n_users)
    total = np.bincount(valid.user, weights=err, minlength=valid.n_users)
    return np.where(n > 0, total / np.maximum(n, 1), 0.0)


def run_epsilon(configs: Sequence[AltMinConfig], epsilon: float, delta: float, n_users: int, n_items: int,
                fixed: Sequence[dp_accounting.DpEvent] = ()) -> float:
    """The per-candidate ε at which the K candidate runs on the declared sizes, composed with the `fixed`
    events (e.g. the selection), spend (epsilon, delta) by the report's own rule (`compute_epsilon` of the
    whole composition, so e.g. the PLD's pessimistic discretisation of a pure-DP selection is budgeted)."""
    def composed(inverse_eps: float):
        return dp_accounting.ComposedDpEvent(list(fixed) + [
            candidate_event(dataclasses.replace(c, epsilon=1.0 / inverse_eps, delta=delta), n_users, n_items)
            for c in configs])
    # ε_run lies between ε/(4K) (well below basic composition) and ε (one run alone).
    k = len(configs)
    return 1.0 / calibrate(composed, epsilon, delta, bracket=(1.0 / epsilon, 4.0 * k / epsilon), tol=1e-3 / epsilon)


def public_grid(cfg: AltMinConfig) -> tuple[AltMinConfig, ...]:
    """The default candidate grid of `fit_tuned` around `cfg`, fixed before seeing any data:
    `cfg` itself, the factor ridge ×1/2 and ×4, and the per-user budget k ×1/2 and ×2. Every candidate keeps
    the rank rule of `default_dim` at its own (smaller) ε_run unless cfg sets dim, so each candidate
    degrades gracefully on its own: even a chance choice (the selection is nearly uniform when ε_sel is
    small) is never a model the defaults would not pick."""
    k = cfg.budget
    return (cfg, dataclasses.replace(cfg, reg_scale=cfg.reg_scale / 2), dataclasses.replace(cfg, reg_scale=cfg.reg_scale * 4),
            dataclasses.replace(cfg, budget=max(1, k // 2)), dataclasses.replace(cfg, budget=2 * k))


def tune_private(train: Interactions, valid: Interactions, configs: Sequence[AltMinConfig], *, epsilon: float,
                 delta: float = 1e-5, selection_fraction: float = 0.1, seed: int | None = None,
                 loss_bound: float | None = None) -> TunedModel:
    """Fits every config at a shared ε_run and privately selects one; see the module docstring.

    Every config must be private and share the rating range; their own epsilon/delta are replaced.
    `seed` seeds all noise (None: fresh OS entropy, recorded in the result).
    """
    epsilon, delta = check_privacy(epsilon, delta, train.n_users, unit="user")
    selection_fraction = check_open_unit(selection_fraction, "selection_fraction")
    configs = tuple(configs)
    if len(configs) < 2:
        raise ValueError(f"configs must hold at least 2 candidate configurations, got {len(configs)}")
    if not all(c.private for c in configs):
        raise ValueError("configs must all be private methods ('als' is the non-private reference)")
    if any(c.sample_rate != 1.0 for c in configs):  # pure-DP selection + subsampled events: no joint accountant
        raise ValueError("tune_private supports full-batch configs only (sample_rate = 1)")
    ranges = {c.scale for c in configs}
    if len(ranges) != 1:
        raise ValueError(f"configs must share one public rating_range, got {sorted(ranges)}")
    if valid.n_users != train.n_users or valid.n_items != train.n_items:
        raise ValueError("train and valid must share the declared id spaces (n_users, n_items)")
    lo, hi = ranges.pop()
    seed = resolve_seed(seed)
    eps_sel = selection_fraction * epsilon
    eps_run = run_epsilon(configs, epsilon, delta, train.n_users, train.n_items, fixed=[selection_event(eps_sel)])
    report = PrivacyReport(delta, unit="user", relation=ADD_OR_REMOVE_ONE)
    models, scores = [], []
    bound = check_positive(loss_bound, "loss_bound") if loss_bound is not None else ((hi - lo) / 2) ** 2
    for c, cfg in enumerate(configs):
        model = fit(train, dataclasses.replace(cfg, epsilon=eps_run, delta=delta), seed=(seed + 1 + c) % 2**63)
        for r in model.report.releases:
            report.add_release(dataclasses.replace(r, name=f"candidate {c}: {r.name}"))
        models.append(model)
        scores.append(-np.minimum(user_validation_losses(model, train, valid), bound).sum())
    key, _ = seeded_key(seed)
    index = select_configuration(key, np.asarray(scores), bound, eps_sel, report)
    return TunedModel(models[index], index, configs, report, eps_run, np.asarray(scores), seed)


def fit_tuned(train: Interactions, cfg: AltMinConfig, seed: int | None = None,
              valid: Interactions | None = None) -> AltMinModel:
    """`fit` with the ridge scale / budget picked from `public_grid(cfg)` privately (`tune_private`: every candidate
    run and the selection in one report of total cfg.epsilon), scoring on `valid` (default: about 10% of the rows
    of `train`, each row chosen by a keyed hash of its own (user, item) pair with the public split seed 0,
    `jdp.data.split_ratings_by_pair_hash`, so that adding or removing a user moves no other user's rows; the
    candidates are fitted on the other rows). The returned model's report covers the whole tuning.
    Unit, relation, public sizes and `seed` as in `fit`."""
    cfg = checked_config(train, cfg)
    if not cfg.private:
        raise ValueError("tune='private' tunes a private method; 'als' is the non-private reference")
    if valid is None:
        # per-row keyed split: one user's rows never move another user's rows between the parts, so
        # neighbouring inputs stay neighbouring (train, valid) pairs, as tune_private's analysis assumes
        train, valid = split_ratings_by_pair_hash(train, TUNE_VALID_FRACTION, seed=TUNE_SPLIT_SEED)
    tuned = tune_private(train, valid, public_grid(cfg), epsilon=cfg.epsilon, delta=cfg.delta, seed=seed)
    model = tuned.model
    model.report, model.seed = tuned.report, tuned.seed
    model.report.assume(f"rank / ridge chosen privately from a public grid of {len(tuned.configs)} "
                        f"(candidate {tuned.index}: dim={model.config.dim}, reg_scale={model.config.reg_scale:g}, "
                        f"budget={model.config.budget})")
    return model


__all__ = ["TUNE_SPLIT_SEED", "TUNE_VALID_FRACTION", "TunedModel", "fit_tuned", "public_grid", "run_epsilon",
           "tune_private", "user_validation_losses"]
