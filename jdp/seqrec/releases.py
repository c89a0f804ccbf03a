"""The privacy set-up of a `jdp.seqrec.train` run: its sampling plan (N, q = B/N, steps), the releases before its
DP-SGD steps (item histogram, item-table start) composed with the steps into one report with σ calibrated for
the total (`privacy_setup`), and the report of a run stopped early (`partial_report`). Unit, relation and the
list of releases: `jdp.seqrec.train`'s docstring."""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import numpy as np
from dp_accounting import dp_event as dpe

from jdp import accounting
from jdp.clipping.dp_sgd import calibrate_noise_multiplier, dp_sgd_release
from jdp.seqrec import reattention as ra
from jdp.seqrec import transitions as tr
from jdp.seqrec.config import TrainConfig
from jdp.seqrec.data import SeqData, item_presence
from jdp.validation import check_privacy

DP_SGD_STEP = "DP-SGD step (Poisson-sampled Gaussian)"  # the report's name of the training steps' release
ITEM_INIT_MAX_NOISE = 500.0  # the largest transition noise std the item start calibrates (its bracket's end)
NONPRIVATE_ITEM_INIT_K = 500  # the item start's candidates in a NON-PRIVATE reference run without item_init_k
DP_FEST_STEP = "DP-SGD step with the item rows selected by noisy counts (DP-FEST; Poisson-sampled Gaussian)"


def sampling_plan(data: SeqData, cfg: TrainConfig) -> tuple[int, float, int]:
    """(N, q = B/N, steps) from the declared public number of users, else from the data's count (which the
    report then states as an assumption: under add/remove-one-user it is private)."""
    n_data = data.n_users
    N = n_data if cfg.n_users_public is None else int(cfg.n_users_public)
    if N < n_data:
        raise ValueError(f"n_users_public ({N}) must be >= the users in the data ({n_data})")
    if cfg.batch_size > N:
        raise ValueError(f"batch_size must be <= number of users ({N}), got {cfg.batch_size}")
    check_privacy(cfg.epsilon, cfg.delta, N, unit="user")  # the one rule: δ < 1/N of the declared users
    return N, cfg.batch_size / N, max(1, int(math.ceil(cfg.epochs * N / cfg.batch_size)))


class PrivacySetup(NamedTuple):
    report: accounting.PrivacyReport | None
    noise_multiplier: float
    item_counts: np.ndarray | None        # for Re-Attention / trainable rows: public or released
    item_start: tr.TransitionModel | None  # item_init="transitions": the release the item table starts from


def privacy_setup(data: SeqData, cfg: TrainConfig, key: jax.Array, public_item_counts: np.ndarray | None = None
                  ) -> PrivacySetup:
    """(report, noise multiplier σ, item counts for Re-Attention, item-table release) for a run of cfg; in a
    NON-PRIVATE run (None, 0, None, the exact transitions or None). DPFormer: caller-declared public counts,
    else a Gaussian histogram release. item_init="transitions": one release of item transitions
    (`jdp.seqrec.transitions.release`, noise std cfg.item_init_noise). The data's vocabulary release
    (vocabulary='private') and these are composed into the same report and σ is calibrated for the total;
    the vocabulary's assumptions (public / exact vocabulary) are stated in the report."""
    cfg.validate()
    start_key = jax.random.fold_in(key, 0x7472)  # the transition release's own noise stream
    if cfg.epsilon is None:
        return PrivacySetup(None, 0.0, None, _item_start(data, cfg, start_key, None, public_item_counts))
    L, M = data.maxlen, data.n_items
    N, q, steps = sampling_plan(data, cfg)
    report = accounting.PrivacyReport(cfg.delta, unit="user", relation=accounting.ADD_OR_REMOVE_ONE)
    if cfg.n_users_public is None:
        report.assume(f"number of users N = {N} treated as public (sets the sampling rate q = B/N and the "
                      "number of steps); declare a public bound with TrainConfig(n_users_public=...)")
    # the vocabulary's own release (private mode) or the assumption it rests on (public / exact)
    for release in data.vocab_releases:
        report.add_release(release)
    for text in data.vocab_assumptions:
        report.assume(text)
    counts_rel = None
    if cfg.model == "dpformer" or cfg.trainable_items:
        if public_item_counts is not None:
            counts_rel = np.asarray(public_item_counts, np.float64)
            if counts_rel.shape != (M + 1,) or not np.isfinite(counts_rel).all():
                raise ValueError(f"public_item_counts must be a finite array of shape ({M + 1},)")
            report.assume("item counts (public_item_counts) declared public by the caller")
        else:
            counts_rel = ra.private_item_counts(key, item_presence(data.train_input, data.train_target, M),
                                                L + 1, cfg.hist_noise_multiplier, report)
    start = _item_start(data, cfg, start_key, report, public_item_counts)
    # DP-SGD's own calibration and report line, its σ calibrated for the steps composed after the releases above
    sigma = calibrate_noise_multiplier(cfg.epsilon, cfg.delta, q, steps,
                                       before=[r.composed_event() for r in report.releases])
    report.add_release(dp_sgd_release(sigma, q, cfg.l2_clip, steps,
                                      name=DP_FEST_STEP if cfg.sparse_item_rows else DP_SGD_STEP))
    return PrivacySetup(report, float(sigma), counts_rel, start)


def check_item_init_k(cfg: TrainConfig, n_items: int) -> None:
    """item_init_k, when given, names at most every item (the vocabulary's size is known before any release)."""
    if cfg.item_init_k is not None and cfg.item_init_k > n_items:
        raise ValueError(f"item_init_k must be <= the number of items ({n_items}), got {cfg.item_init_k}")


def _popularity_release(public_item_counts: bool) -> list:
    """The item start's popularity histogram as events: none when the caller declares public counts."""
    return [] if public_item_counts else [accounting.gaussian_event(tr.HIST_NOISE_MULTIPLIER)]


def start_fits(cfg: TrainConfig, public_item_counts: bool) -> bool:
    """Whether the item start's releases fit in their share of ε (`TrainConfig.item_init_epsilon_share`) at the
    largest noise it calibrates (public quantities only); always True for a declared noise or a NON-PRIVATE run."""
    if cfg.epsilon is None or cfg.item_init_noise is not None:
        return True
    hist = _popularity_release(public_item_counts)
    return accounting.compute_epsilon(dpe.ComposedDpEvent(hist + [accounting.gaussian_event(ITEM_INIT_MAX_NOISE)]),
                                      cfg.delta) < cfg.item_init_epsilon_share() * cfg.epsilon


def uses_transition_prior(cfg: TrainConfig, public_item_counts: bool) -> bool:
    """Whether the run adds the transition prior: `TrainConfig.uses_transition_prior`, off where an "auto" start
    falls back to random (`start_fits`); a prior asked for there (`transition_prior=True`) is refused."""
    if cfg.item_init == "auto" and cfg.uses_transition_prior() and not start_fits(cfg, public_item_counts):
        if cfg.transition_prior:
            raise ValueError(f"transition_prior needs the item start's release, which cannot fit in "
                             f"{cfg.item_init_epsilon_share():g} of epsilon={cfg.epsilon:g}: raise epsilon, or "
                             "declare item_init_noise")
        return False
    return cfg.uses_transition_prior()


def item_start_noise(cfg: TrainConfig, public_item_counts: bool) -> float | None:
    """The item start's transition noise std in a private run: `item_init_noise`, else calibrated so that the item
    releases alone (with the popularity histogram unless its counts are public) spend `item_init_epsilon_share()` of
    ε; None where an "auto" start cannot fit (random start; a prior asked for there is refused). Public quantities
    only, so the first step's shapes can be known before the releases are made (`item_start_k`)."""
    if cfg.item_init == "auto" and not start_fits(cfg, public_item_counts):
        uses_transition_prior(cfg, public_item_counts)  # refuses a prior asked for here
        return None  # "auto": the start's releases cannot fit in their share of a small ε (public): random start
    if cfg.item_init_noise is not None:
        return float(cfg.item_init_noise)
    hist = _popularity_release(public_item_counts)
    return accounting.calibrate(lambda s: dpe.ComposedDpEvent(hist + [accounting.gaussian_event(s)]),
                                cfg.item_init_epsilon_share() * cfg.epsilon, cfg.delta,
                                bracket=(0.05, ITEM_INIT_MAX_NOISE))


def item_start_k(data: SeqData, cfg: TrainConfig, noise_std: float | None) -> int:
    """The item start's candidates: `item_init_k`, else `transitions.default_k` of the declared users and the
    release's noise (public), or NONPRIVATE_ITEM_INIT_K in the NON-PRIVATE reference (noise_std None)."""
    if cfg.item_init_k is not None:
        return int(cfg.item_init_k)
    if noise_std is None:
        return min(NONPRIVATE_ITEM_INIT_K, data.n_items)
    n_users = data.n_users if cfg.n_users_public is None else int(cfg.n_users_public)
    return tr.default_k(n_users, noise_std, data.n_items)


def _item_start(data: SeqData, cfg: TrainConfig, key: jax.Array, report: accounting.PrivacyReport | None,
                public_item_counts: np.ndarray | None) -> tr.TransitionModel | None:
    """item_init="transitions" (or "auto" resolved to it, `TrainConfig.item_start`): the transition release the
    item table starts from, added to `report` (exact when report is None: the NON-PRIVATE reference); its noise
    (`item_start_noise`) and candidates, the top `item_start_k` of its own popularity release or of the declared
    public counts. None (random start) for "auto" when the releases cannot fit in their share of ε."""
    if cfg.item_start() != "transitions":
        return None
    check_item_init_k(cfg, data.n_items)
    noise_std = cfg.item_init_noise
    if report is not None:
        noise_std = item_start_noise(cfg, public_item_counts is not None)
        if noise_std is None:
            return None
        if cfg.item_init_noise is not None:
            hist = _popularity_release(public_item_counts is not None)
            spent = accounting.compute_epsilon(dpe.ComposedDpEvent(
                [r.composed_event() for r in report.releases] + hist + [accounting.gaussian_event(noise_std)]),
                cfg.delta)
            if spent >= cfg.epsilon:
                raise ValueError(f"the releases before DP-SGD (item table start: item_init_noise={noise_std:g}) "
                                 f"already spend epsilon={spent:.3g} >= {cfg.epsilon:g}: raise item_init_noise "
                                 "or epsilon")
    k = item_start_k(data, cfg, noise_std if report is not None else None)
    return tr.release(data, k, key, report, noise_std, public_item_counts=public_item_counts)


def partial_report(report: accounting.PrivacyReport, steps_done: int, steps: int) -> accounting.PrivacyReport:
    """The report of a run stopped after `steps_done` of its `steps` planned DP-SGD steps: every release before
    training as planned, the DP-SGD step (the last release, `privacy_setup`) counted `steps_done` times."""
    ran = dataclasses.replace(report, releases=list(report.releases[:-1]), assumptions=list(report.assumptions))
    if steps_done > 0:
        ran.add_release(dataclasses.replace(report.releases[-1], count=int(steps_done)))
    ran.assume(f"the run stopped after {steps_done} of its {steps} planned DP-SGD steps: epsilon covers the steps "
               "that ran (the noise was calibrated for all of them; continuing it spends up to the planned epsilon)")
    return ran


__all__ = ["DP_FEST_STEP", "DP_SGD_STEP", "PrivacySetup", "check_item_init_k", "item_start_k", "item_start_noise",
           "partial_report", "privacy_setup", "sampling_plan", "start_fits", "uses_transition_prior"]
