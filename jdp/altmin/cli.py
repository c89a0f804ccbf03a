"""`jdp altmin`: DP alternating minimization on synthetic data, a MovieLens dataset or a MovieLens file."""
from __future__ import annotations

import argparse
import os
import pathlib

from jdp.altmin.config import METHODS, AltMinConfig, Method
from jdp.cli_support import (add_data_dir_arguments, add_seed_arguments, check_at_least, check_flag_privacy, flag_names,
                     no_out_hint, noise_seed, privacy_lines, write_result)

# The named MovieLens datasets jdp.data.fetch downloads; their public rating scales are the published
# releases' (jdp.data.movielens.RELEASES): 1-5 in whole stars for ml-100k / ml-1m, 0.5-5 in half stars after.
MOVIELENS_DATASETS = ("ml-100k", "ml-1m", "ml-10m", "ml-20m", "ml-latest-small")
GENERATED = ("synthetic", "synthetic-movielens")
DEFAULT_EPSILON = 1.0
# the library's names of what the flags set: its refusals are shown with the flags
FLAGS = {"epsilon": "--epsilon", "delta": "--delta", "mu": "--mu", "dim": "--dim", "steps": "--steps",
         "budget": "--budget", "ratings_per_user": "--ratings-per-user", "rating_range": "--rating-range",
         "n_users": "--n-users", "seed": "--seed"}


def load_data(name: str | None, path: str | None, data_seed: int = 0, n_users: int = 20_000, n_items: int = 2_000,
              nnz: int = 1_000_000, *, public_users: int | None = None, item_catalogue: str | None = None,
              data_dir: str | None = None, sha256: str | None = None, progress: bool = True,
              rating_range: tuple[float, float] | None = None):
    """`synthetic` (planted low-rank, Zipf popularity), `synthetic-movielens` (planted, calibrated to
    MovieLens: log-normal marginals, item / user biases), a named MovieLens dataset (`MOVIELENS_DATASETS`:
    read from `path` if given, else downloaded on first use by `jdp.data.fetch` into `data_dir`), or
    `movielens` (any standard file at `path`). `name` None: `movielens` when a `path` is given (the file's
    format tells; anything else is refused), else `synthetic`. A given input is never ignored: a `path`, a
    user bound, a catalogue or a hash with generated data is refused, as is a hash with a `path`.

    Generated data have declared sizes (n_users, n_items). For MovieLens files the item catalogue is
    `item_catalogue` (u.item / movies.dat / movies.csv or its folder), else an item file next to the
    ratings when there is one, else the rated items (data-dependent); the user bound is
    `public_users`, else the users in the file (data-dependent). The rating scale is public: `rating_range`
    when declared, else the named release's, else the file format's (`jdp.data.movielens_scale`: u.data and
    ML-1M's ratings.dat 1-5 in whole stars, ML-10M's ratings.dat and ratings.csv 0.5-5 in half stars, a lone
    ratings.dat their superset 0.5-5, said in a note); never the ratings' values or the file's name, and
    ratings off the scale are refused. Returns (data, rating range, notes): the notes say which scale was
    used and which sizes were NOT declared (added to the report's assumptions).
    """
    from jdp.data import fetch, load_movielens, load_movielens_items, movielens_scale, planted_movielens, planted_powerlaw
    if name is None:
        name = "movielens" if path else "synthetic"
    if name in GENERATED:
        given = [flag for flag, value in (("--data-path", path), ("--n-users", public_users),
                                          ("--item-catalogue", item_catalogue), ("--data-sha256", sha256)) if value]
        if given:
            raise ValueError(f"--data {name} generates its ratings (sizes from --synthetic-size) and reads no file, "
                             f"so {' and '.join(given)} would be ignored: drop {'them' if len(given) > 1 else 'it'}, or "
                             f"read your file with --data movielens --data-path FILE (or a named ml-* dataset)")
        generate = planted_powerlaw if name == "synthetic" else planted_movielens
        scale = tuple(rating_range) if rating_range else (0.5, 5.0)  # the generators' scale, unless declared
        return generate(seed=data_seed, n_users=n_users, n_items=n_items, nnz=nnz).data, scale, []
    if path and sha256:
        raise ValueError(f"--data-sha256 checks a download, but --data-path {path} downloads nothing: drop one of them")
    if name in MOVIELENS_DATASETS:
        if not path and name == "ml-100k":
            path = os.environ.get("JDP_ML100K")  # older name of --data-path for ML-100K, still honoured
        if not path:
            path = str(fetch(name, data_dir, progress, sha256=sha256))
        scale = movielens_scale(path, release=name, rating_range=rating_range)
    elif name == "movielens":
        if not path:
            raise ValueError("--data movielens needs --data-path (u.data, ratings.dat, ratings.csv or their folder)")
        scale = movielens_scale(path, rating_range=rating_range)
    else:
        raise ValueError(f"unknown --data {name!r}")
    notes = [f"rating scale: {scale.describe()}" + (" (--rating-range)" if rating_range else "")]
    if scale.note:
        notes.append(scale.note)
    folder = pathlib.Path(path) if pathlib.Path(path).is_dir() else pathlib.Path(path).parent
    if item_catalogue is None and any((folder / f).is_file() for f in ("u.item", "movies.dat", "movies.csv")):
        item_catalogue = str(folder)
    if item_catalogue is None:
        notes.append("n_items = the items rated in the file (data-dependent; pass --item-catalogue for a release)")
    if public_users is None:
        notes.append("n_users = the users in the file (data-dependent; pass --n-users for a release)")
    items = None if item_catalogue is None else load_movielens_items(item_catalogue)
    return load_movielens(path, n_users=public_users, item_ids=items, rating_range=scale), scale.range, notes


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("altmin", help="DP alternating minimization (DPALS / AdaDPALS / DPSGD ...)",
                       description="Train a user-level DP matrix-factorization recommender and report RMSE, "
                                   "per-popularity-bucket RMSE and the privacy report.")
    p.add_argument("--data", choices=[*GENERATED, *MOVIELENS_DATASETS, "movielens"], default=None,
                   help="synthetic: planted, Zipf popularity; synthetic-movielens: planted, MovieLens-calibrated; "
                        "ml-*: the GroupLens dataset, downloaded on first use (see --data-dir); movielens: any "
                        "MovieLens ratings file given by --data-path. Default: movielens with --data-path, else "
                        "synthetic")
    p.add_argument("--data-path", default=None,
                   help="MovieLens ratings file or folder (u.data, ratings.dat, ratings.csv, as published); for ml-* "
                        "it replaces the download; refused with generated data. The format (and rating scale) is read "
                        "from the file")
    add_data_dir_arguments(p)
    p.add_argument("--method", choices=METHODS, default="ada-dpals")
    p.add_argument("--epsilon", type=float, default=None,
                   help=f"total ε (default: {DEFAULT_EPSILON}); refused with the non-private 'als'")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--mu", type=float, default=0.25, help="adaptive-weight exponent (ada-* methods)")
    p.add_argument("--dim", type=int, default=None, help="embedding dimension (default: from the data sizes and the noise, see default_dim)")
    p.add_argument("--steps", type=int, default=None, help="alternating steps (default depends on ε)")
    p.add_argument("--budget", type=int, default=100, help="per-user budget k (Σ_i w_ij² ≤ k)")
    p.add_argument("--ratings-per-user", type=float, default=None,
                   help="PUBLIC mean of min(ratings, k) per user, if known (default: the rank rule checks its rank "
                        "against a private release of the total, 5%% of ε, when it would pick factors)")
    p.add_argument("--tune", choices=["none", "private"], default="none",
                   help="private: choose the item ridge / budget from a small public grid with a DP selection on the "
                        "validation ratings; the report covers every candidate run and the choice")
    p.add_argument("--item-bias-mean", choices=["zero", "popularity"], default=None,
                   help="SSP methods at rank 0: centre of the item-bias prior, a line in the released log count "
                        "fitted to the well-resolved items (popularity, the default; post-processing of the same "
                        "release) or 0")
    p.add_argument("--n-shards", type=int, default=0, help="devices for the item update (0 = all local devices)")
    p.add_argument("--synthetic-size", type=int, nargs=3, metavar=("USERS", "ITEMS", "RATINGS"),
                   default=(20_000, 2_000, 1_000_000))
    p.add_argument("--n-users", type=int, default=None,
                   help="MovieLens: public bound on the number of users (default: the users in the file, "
                        "data-dependent)")
    p.add_argument("--rating-range", type=float, nargs=2, default=None, metavar=("LO", "HI"),
                   help="the public rating scale (default: the published release's, from the file's format: 1 5 for "
                        "u.data and ML-1M, 0.5 5 for ML-10M and ratings.csv)")
    p.add_argument("--item-catalogue", default=None,
                   help="MovieLens: public item catalogue (u.item, movies.dat, movies.csv or their folder; "
                        "default: one next to the ratings, else the rated items, data-dependent)")
    p.add_argument("--merge-duplicates", action="store_true",
                   help="merge duplicate (user, item) ratings into their mean (default: reject them)")
    add_seed_arguments(p)
    p.add_argument("--out", default=None, help="JSON output file")
    p.add_argument("--plot", default=None, help="PNG: test RMSE per popularity bucket beside the zero-cost baselines")
    p.set_defaults(func=run)


def check_args(args: argparse.Namespace) -> tuple[bool, float | None, bool]:
    """Every option that can be checked without the data, before any work (reading or generating ratings, drawing
    the seed); refusals name the flags. Returns (private, ε, whether the number of users is known already)."""
    private = Method.parse(args.method).private
    if not private and args.epsilon is not None:
        raise ValueError(f"--epsilon {args.epsilon:g} would be ignored: --method {args.method} is the non-private "
                         "reference (no noise, reported as epsilon = inf); drop --epsilon or choose a private --method")
    if args.tune == "private" and not private:
        raise ValueError("--tune private tunes a private method; 'als' is the non-private reference")
    epsilon = (DEFAULT_EPSILON if args.epsilon is None else args.epsilon) if private else None
    generated = (args.data or ("movielens" if args.data_path else "synthetic")) in GENERATED
    if generated:
        for what, value in zip(("USERS", "ITEMS", "RATINGS"), args.synthetic_size):
            if value < 1:
                raise ValueError(f"--synthetic-size {what} must be >= 1, got {value}")
    check_at_least(args, {"n_users": 1, "dim": 0, "steps": 1, "budget": 1, "n_shards": 0})
    # the configuration's own checks (mu, ratings-per-user, rating range, ...) and the one privacy rule, with the
    # flags' names: δ < 1/n where n is known now (generated or declared users)
    n_users = args.synthetic_size[0] if generated else args.n_users
    with flag_names(FLAGS):
        AltMinConfig(method=args.method, epsilon=epsilon, delta=args.delta, mu=args.mu, dim=args.dim, steps=args.steps,
                     budget=args.budget, ratings_per_user=args.ratings_per_user,
                     rating_range=tuple(args.rating_range) if args.rating_range else None).resolve(n_users)
    return private, epsilon, n_users is not None


def run(args: argparse.Namespace) -> int:
    from jdp.altmin.experiment import rating_experiment
    private, epsilon, n_users_known = check_args(args)
    with flag_names(FLAGS):
        data, rating_range, notes = load_data(args.data, args.data_path, args.data_seed, *args.synthetic_size,
                                              public_users=args.n_users, item_catalogue=args.item_catalogue,
                                              data_dir=args.data_dir, sha256=args.data_sha256,
                                              rating_range=tuple(args.rating_range) if args.rating_range else None)
    if private and not n_users_known:  # δ < 1/n of the user id space now known (the users in the file)
        check_flag_privacy(epsilon, args.delta, data.n_users, unit="user")
    cfg = AltMinConfig(method=args.method, epsilon=epsilon,
                       delta=args.delta, mu=args.mu, dim=args.dim, steps=args.steps, budget=args.budget,
                       ratings_per_user=args.ratings_per_user, rating_range=rating_range, n_shards=args.n_shards or None,
                       merge_duplicates=args.merge_duplicates,
                       **({"item_bias_mean": args.item_bias_mean} if args.item_bias_mean else {}))
    row = rating_experiment(data, cfg, seed=noise_seed(args), split_seed=args.data_seed,
                            tune=None if args.tune == "none" else args.tune)
    row["data"] = args.data or ("movielens" if args.data_path else "synthetic")
    row["privacy"]["assumptions"] += notes
    m = row["metrics"]
    warnings = []
    if private and m["rmse_test"] > m["rmse_zero_cost_test"]:
        warnings.append(f"the private model (test RMSE {m['rmse_test']:.4f}) is worse than the zero-cost baseline "
                        f"({m['rmse_zero_cost_test']:.4f}: each user's own bias on the public prior, nothing released): "
                        "at this epsilon and data size the release does not pay for itself")
        row.setdefault("warnings", []).extend(warnings)
    wrote = []  # the files first: a closed pipe on stdout (`| head`) cannot lose them
    if args.out:
        wrote.append(write_result(args.out, row))
    if args.plot:
        from jdp.plots import altmin_run
        wrote.append(f"wrote {altmin_run(row, args.plot)}")
    shape = row.get("data_shape") or {}
    generated = " (GENERATED)" if str(row["data"]).startswith("synthetic") else ""
    summary = [f"data: {row['data']}{generated}, {shape.get('n_users', 0):,} users x {shape.get('n_items', 0):,} items, "
               f"{shape.get('nnz', 0):,} ratings",
               f"{row['method']}  epsilon={row['epsilon']}  rank={row['config']['dim']}  RMSE test={m['rmse_test']:.4f} "
               f"valid={m['rmse_valid']:.4f}",
               f"zero-cost baselines (nothing released): prior only {m['rmse_prior_only_test']:.4f}, "
               f"prior + each user's own bias {m['rmse_zero_cost_test']:.4f}",
               "RMSE by popularity bucket (tail -> head): " + "  ".join(f"{x:.4f}" for x in m["sliced"]["rmse_test"])]
    summary += privacy_lines(row["privacy"] if private else {"non_private": True})
    summary += [f"WARNING: {w}" for w in warnings] + wrote + no_out_hint(args)
    print("\n".join(summary))
    return 0
