"""One rating-prediction experiment (ML10M protocol): split 80/10/10, fit, RMSE (+ per-bucket).

Every row also carries the zero-cost baselines on the same split: the public prior μ alone, and the prior plus
each user's own bias solved on the user's side (`zero_cost_model`, nothing released): a private model should
never do worse than the latter.

Validation RMSE uses user embeddings solved on train; test RMSE re-solves them on train ∪ valid, as
in the reference protocol. Buckets: items sorted by TRAINING count, 5 equal-size buckets (tail
first); evaluation statistics are not released by the mechanism. The model's public sizes are
`data.n_users` / `data.n_items` (declared by whoever built `data`; see `jdp.altmin.train`); the
exact `nnz` in "data_shape" and the metrics are evaluation outputs, not part of the private release.
Duplicate (user, item) rows in `data` raise ValueError; with `cfg.merge_duplicates` they are merged
BEFORE splitting, so no pair is in both train and test.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from jdp.altmin.config import AltMinConfig
from jdp.altmin.train import fit, zero_cost_model
from jdp.altmin.tuning import fit_tuned
from jdp.data import Interactions, check_unique_pairs, concat, split_ratings
from jdp.metrics import popularity_buckets, rmse, sliced_rmse


def rating_experiment(data: Interactions, cfg: AltMinConfig, seed: int | None = None, split_seed: int = 0,
                      tune: str | None = None) -> dict:
    """Fits `cfg` on an 80/10/10 split of `data` and returns a JSON-ready result row.

    `seed` is the noise seed (None: fresh OS entropy; the one used is in the row); `split_seed` the
    public randomness of the split. `tune="private"` tunes privately on the validation part (`fit_tuned`)."""
    if tune not in (None, "private"):
        raise ValueError(f"tune must be None or 'private', got {tune!r}")
    if cfg.merge_duplicates:
        data = data.merge_duplicates()
    else:  # checked on the whole data: whether copies land in train must not depend on the split
        check_unique_pairs(data.user, data.item, ("user", "item"), "rating_experiment: data",
                           "AltMinConfig(merge_duplicates=True) merges each pair into its mean rating")
    train, valid, test = split_ratings(data, (0.8, 0.1, 0.1), seed=split_seed)
    t0 = time.perf_counter()
    model = fit_tuned(train, cfg, seed, valid) if tune else fit(train, cfg, seed)
    fit_seconds = time.perf_counter() - t0
    buckets = popularity_buckets(train.item_counts())
    t1 = time.perf_counter()
    u_valid = model.user_factors(train)
    pred_valid = model.predict(u_valid, valid.user, valid.item)
    u_test = model.user_factors(concat([train, valid]))
    pred_test = model.predict(u_test, test.user, test.item)
    free = zero_cost_model(train, cfg)  # prior + each user's own bias: what every user has without any release
    pred_free = free.predict(free.user_factors(concat([train, valid])), test.user, test.item)
    metrics = {
        "rmse_valid": rmse(pred_valid, valid.rating),
        "rmse_test": rmse(pred_test, test.rating),
        "rmse_zero_cost_test": rmse(pred_free, test.rating),
        "rmse_prior_only_test": rmse(np.full(test.nnz, free.mean), test.rating),
        "sliced": {"bucket_definition": "items sorted by training count, 5 equal-size buckets, 0 = tail",
                   "rmse_test": sliced_rmse(pred_test, test.rating, test.item, buckets, 5)},
    }
    resolved = model.config
    return {
        "method": resolved.method + (f" (tuned {tune})" if tune else ""),
        "epsilon": cfg.epsilon if tune else resolved.epsilon,  # tuned: the total, not one candidate's share
        "delta": resolved.delta if resolved.private else None,
        "mu": resolved.mu if resolved.parsed_method.allocation == "adaptive" else None,
        "seed": model.seed,
        "split_seed": split_seed,
        "metrics": metrics,
        "privacy": model.report.to_dict(),
        "noise_multiplier": model.noise_multiplier,
        "config": {k: v for k, v in dataclasses.asdict(resolved).items() if k != "show_progress"},
        "timings": {**model.timings, "fit_seconds": fit_seconds, "eval_seconds": time.perf_counter() - t1},
        "data_shape": {"n_users": data.n_users, "n_items": data.n_items, "nnz": data.nnz},
    }
