"""`jdp seqrec`: DP training + full-ranking evaluation of DPFormer and baselines.

Example (Video.txt is downloaded on first use into --data-dir, default $JDP_DATA or ~/.cache/jdp):
  jdp seqrec --data amazon-games --model dpformer --epsilon 8 --epochs 100 --batch-size 1024 --lr 3e-3 \\
      --out run.json
`--data synthetic` (planted next-item sequences, no download) is a quick first run: by default one
Transformer block of width 32, no dropout, 2 epochs at batch 256, lr 8e-2, windows of the last 20 items (the planted
rule is first-order) and one window length, so one compiled step shape.
`--model transitions --k K`: no training, one release of item-to-item transitions (jdp.seqrec.transitions);
`--item-init transitions`: a Transformer whose item table starts from such a release (beyond the paper).
`--epsilon 0` is not allowed; `--non-private` trains the explicitly non-private reference.
Item vocabulary: `--vocabulary sasrec-exact` (default, the papers' protocol: exact item counts, stated
in the report as an assumption NOT covered by ε), `public` (the `--item-catalogue` is the vocabulary) or
`private` (DP histogram + threshold over the catalogue, accounted in the report). The catalogue is a
MovieLens item file (u.item / movies.dat) or a .npy / text file of raw item ids.
"""
from __future__ import annotations

import argparse
import logging
import os
import pathlib
import time

import numpy as np

from jdp.cli_support import (add_data_dir_arguments, add_deprecated_flag, add_seed_arguments, check_at_least,
                             check_flag_privacy, flag_names, move_to_group, no_out_hint, noise_seed, privacy_lines,
                             write_result)
from jdp.clipping.engine import METHODS as CLIPPING_METHODS
from jdp.seqrec.config import (DEFAULT_WINDOWS, ITEM_INIT_EPSILON_SHARE, ITEM_INITS, NEGATIVE_SAMPLERS, OPTIMIZERS,
                                PRIOR_EPSILON_SHARE, TrainConfig)
from jdp.seqrec.models import MODELS, NORMS


def register(subparsers) -> None:
    p = subparsers.add_parser("seqrec", help="DP sequential recommendation (DPFormer, Transformer, GRU, LSTM)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_data_flags(p)
    _add_privacy_flags(p)
    _add_architecture_flags(p)
    _add_item_flags(p)
    _add_run_flags(p)
    for title, dests in HELP_GROUPS.items():
        move_to_group(p, title, dests)
    p.set_defaults(func=run)


def _add_data_flags(p: argparse.ArgumentParser) -> None:
    """The flags of data and the model choice."""
    p.add_argument("--data", required=True, choices=["amazon-games", "ml-100k", "ml-1m", "synthetic"],
                   help="a published dataset (downloaded on first use, see --data-dir) or 'synthetic' "
                        "(jdp.data.synthetic.planted_sequences with --data-seed: no download)")
    p.add_argument("--data-path", default=None, help="file (Video.txt / u.data / ratings.dat) or its folder; "
                   "replaces the download; must be in the named dataset's format; refused with --data synthetic")
    add_data_dir_arguments(p)
    p.add_argument("--model", default="dpformer", choices=[*MODELS, "transitions"],
                   help="a network trained by DP-SGD, or 'transitions': item-to-item transitions from ONE release "
                        "(jdp.seqrec.transitions; its popularity release has noise std 4)")
    p.add_argument("--k", type=int, default=None,
                   help="transitions: number of candidate items (a public choice; default: the rule "
                        "round(2.5 sqrt(users / sigma)) of the release's sigma, e.g. 548 on Amazon Games and 96 on "
                        "ML-100K at ε = 8; --non-private needs it)")
    p.add_argument("--history", type=int, default=3, help="transitions: recent items whose rows score a user")


def _add_privacy_flags(p: argparse.ArgumentParser) -> None:
    """The flags of privacy and the optimiser."""
    p.add_argument("--epsilon", type=float, default=None, help=f"(default: {DEFAULT_EPSILON}); refused with --non-private")
    p.add_argument("--non-private", action="store_true",
                   help="NON-PRIVATE reference run (no noise; refused beside --epsilon)")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--epochs", type=float, default=None,
                   help="default 100 (the paper's protocol) / 2 with --data synthetic (a quick first run)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="expected Poisson batch size; default 1024 / 256 with --data synthetic")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate; default 1e-3 / 8e-2 with --data synthetic")
    p.add_argument("--weight-decay", type=float, default=1e-5)
    p.add_argument("--warmup-frac", type=float, default=0.2)
    p.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS),
                   help="after DP-SGD's noisy mean: AdamW (the paper's), adam-bc (DP-AdamBC: Adam's second moment minus "
                        "the known noise variance) or sgd-momentum (momentum 0.9)")
    p.add_argument("--adam-bc-gamma", type=float, default=10.0,
                   help="adam-bc: the floor of its second moment, in units of the noise variance (sigma C / B)^2")
    p.add_argument("--sparse-item-rows", action="store_true",
                   help="DP-FEST on the item table (beyond the paper): each step noises and updates only the rows "
                        "selected from noisy counts of the sampled users' items; the same epsilon")
    p.add_argument("--sparse-ratio", type=float, default=2.0,
                   help="--sparse-item-rows: the selection's noise over the gradient's (sigma_r / sigma_g)")
    p.add_argument("--sparse-threshold", type=float, default=3.0,
                   help="--sparse-item-rows: the selection threshold in units of sigma_r")
    p.add_argument("--l2-clip", type=float, default=1.0, help="per-user L2 clip norm C")
    add_deprecated_flag(p, "--clip", "--l2-clip")  # its name before this release
    p.add_argument("--normalize", action="store_true",
                   help="normalised clipping g·C/||g|| (the DPFormer paper's variant) instead of min(1, C/||g||)")


def _add_architecture_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the network."""
    p.add_argument("--maxlen", type=int, default=None, help="default 50 (Amazon) / 200 (MovieLens) / 20 (synthetic)")
    p.add_argument("--d", type=int, default=None, help="model width; default 64 (the paper's) / 32 with --data synthetic")
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--blocks", type=int, default=None,
                   help="Transformer blocks; default 2 (the paper's) / 1 with --data synthetic (a quick first run: "
                        "half the step to compile)")
    p.add_argument("--norm", default="pre", choices=list(NORMS),
                   help="Transformer blocks: pre-LayerNorm (SASRec, default) or post-LayerNorm (Vaswani et al.)")
    p.add_argument("--ffn-dim", type=int, default=None, help="Transformer feed-forward width (default d)")
    p.add_argument("--item-dim", type=int, default=None,
                   help="vanilla Transformers: item table width r < d, with learned r->d (input) and d->r (output) "
                        "projections (default d)")
    p.add_argument("--dropout", type=float, default=None,
                   help="default 0.2 with the transition prior, else 0.5 (Amazon: TrainConfig.dropout_rate) / 0.2 "
                        "(MovieLens) / 0 (synthetic: the quick run)")


def _add_item_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the item table and its releases."""
    p.add_argument("--hist-noise-multiplier", type=float, default=10.0,
                   help="DPFormer item histogram noise / sqrt(maxlen+1)")
    p.add_argument("--public-item-counts", default=None,
                   help=".npy of per-item counts [M+1] the caller DECLARES public (no histogram release)")
    p.add_argument("--vocabulary", default="sasrec-exact", choices=["sasrec-exact", "public", "private"],
                   help="item vocabulary: exact counts (not private; stated in the report), a public "
                        "catalogue, or a DP histogram + threshold over the catalogue")
    p.add_argument("--item-catalogue", default=None, help="public raw item ids (MovieLens item file, .npy or text)")
    p.add_argument("--min-item-count", type=float, default=5.0, help="item filter threshold (users per item)")
    p.add_argument("--vocab-noise-multiplier", type=float, default=10.0,
                   help="private vocabulary histogram noise / sqrt(maxlen+2)")
    p.add_argument("--mask-history", action="store_true", help="remove history items from the ranking")
    p.add_argument("--clipping", default="auto", choices=list(CLIPPING_METHODS),
                   help="jdp.clipping method (vmap: the exact per-example reference, B x params memory)")
    p.add_argument("--chunk-rows", type=int, default=None,
                   help=f"users x window positions per compiled chunk (compute only); default {TrainConfig.chunk_rows} / "
                        "1.25 x batch x maxlen with --data synthetic (a step is one chunk: one compiled shape)")
    p.add_argument("--negatives", type=int, default=0,
                   help="sampled softmax with K negatives per step (0 = full softmax, the paper's); evaluation "
                        "always ranks the full catalogue")
    p.add_argument("--negative-sampler", default="uniform", choices=list(NEGATIVE_SAMPLERS),
                   help="popularity: in proportion to public (--public-item-counts) or DPFormer's released counts")
    p.add_argument("--trainable-items", type=int, default=0,
                   help="train only the embedding rows of the K items with the largest public (--public-item-counts) "
                        "or released counts (a private run releases the item histogram for it); 0 = every row")
    p.add_argument("--item-init", default="auto", choices=list(ITEM_INITS),
                   help="transitions (beyond the paper; dpformer / transformer): the item table starts from ONE release "
                        "of item-to-item transitions (jdp.seqrec.transitions) in the same report, and the blocks' "
                        "residual branches start at 0, so training starts from that release's scorer; random: the "
                        "paper's start; auto: transitions for a private dpformer / transformer run, else random")
    p.add_argument("--freeze-item-table", action="store_true",
                   help="the item table never trains (not differentiated; the noise drawn for it is discarded): with "
                        "--item-init transitions it keeps the release and DP-SGD trains the rest of the model")
    p.add_argument("--item-init-k", type=int, default=None,
                   help="the item start's candidate items (a public choice); default: the transitions model's rule "
                        "round(2.5 sqrt(N / sigma)) of the users N and the release's noise sigma (500 non-private)")
    p.add_argument("--transition-prior", action=argparse.BooleanOptionalAction, default=None,
                   help="the item start's release also scores every position (beyond the paper): log(1 + its positive "
                        "transition scores over the last 3 items, in units of its noise) x a learned scale is added "
                        "to the logits; default: on wherever the run starts from the release with a full softmax")
    p.add_argument("--item-init-noise", type=float, default=None,
                   help="--item-init transitions: the release's noise std (per-user Frobenius norm 1); default: the "
                        f"item releases alone spend {PRIOR_EPSILON_SHARE:g} of epsilon with the transition prior, "
                        f"{ITEM_INIT_EPSILON_SHARE:g} without")


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """The flags of windows, evaluation, long runs and outputs."""
    p.add_argument("--length-buckets", default=None,
                   help="comma-separated shorter windows for short sequences (compute only; '' = none); default "
                        f"{','.join(map(str, DEFAULT_WINDOWS))} / none with --data synthetic (one compiled shape)")
    p.add_argument("--eval-every", type=float, default=0.0,
                   help="validation NDCG every N epochs (0 = end only); recorded in the history and the curve plot")
    p.add_argument("--n-users", type=int, default=None,
                   help="declared public bound on the number of users (sets q = B/N and the steps; default: "
                        "the data's count, stated in the report as treated public)")
    p.add_argument("--checkpoint", default=None, help="checkpoint file, written every epoch (resumed with --resume)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint (same data, config and --seed)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many steps of this call (resume later with --checkpoint; the report covers "
                        "the steps that ran)")
    add_seed_arguments(p)
    p.add_argument("--time-limit", type=float, default=None,
                   help="stop after the step that ends this many seconds into training (like --max-steps; "
                        "the results record the epochs actually run)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--show-private-diagnostics", action="store_true",
                   help="progress also shows the training loss, sample sizes and non-finite users dropped: PRIVATE "
                        "quantities computed without noise (not in the privacy report); off by default")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="time budget of this call: training stops at the last epoch boundary that fits (after the "
                        "step that crosses it if an epoch takes longer than estimated), writes --checkpoint "
                        "(required) and reports where it stopped; the same command with --resume continues it. The "
                        "privacy report covers the steps that ran. Evaluation after the stop is not in the budget")
    p.add_argument("--out", default=None, help="write the full result as JSON here (the summary is printed)")
    p.add_argument("--plot", default=None, help="PNG: training loss and validation NDCG per epoch")


DEFAULT_EPSILON = 8.0
# the library's names of what the flags set (TrainConfig, data.load): its refusals are shown with the flags
FLAGS = {"epsilon": "--epsilon", "delta": "--delta", "epochs": "--epochs", "lr": "--lr", "l2_clip": "--l2-clip",
         "optimizer": "--optimizer", "adam_bc_gamma": "--adam-bc-gamma", "sparse_ratio": "--sparse-ratio",
         "sparse_threshold": "--sparse-threshold", "sparse_item_rows": "--sparse-item-rows",
         "transition_prior": "--transition-prior",
         "hist_noise_multiplier": "--hist-noise-multiplier", "weight_decay": "--weight-decay",
         "warmup_frac": "--warmup-frac", "batch_size": "--batch-size", "chunk_rows": "--chunk-rows", "d": "--d",
         "heads": "--heads", "blocks": "--blocks", "maxlen": "--maxlen", "dropout": "--dropout",
         "ffn_dim": "--ffn-dim", "item_dim": "--item-dim", "negatives": "--negatives",
         "trainable_items": "--trainable-items", "item_init_k": "--item-init-k", "item_init_noise": "--item-init-noise",
         "eval_every_epochs": "--eval-every", "length_buckets": "--length-buckets", "n_users_public": "--n-users",
         "min_item_count": "--min-item-count", "vocab_noise_multiplier": "--vocab-noise-multiplier",
         "k": "--k", "history": "--history"}


# `jdp seqrec --help`, grouped (the options not named here stay under "options")
HELP_GROUPS = {
    "data": ["data", "data_path", "data_dir", "data_sha256", "data_seed", "maxlen", "n_users", "vocabulary",
             "item_catalogue", "min_item_count", "vocab_noise_multiplier", "public_item_counts"],
    "privacy": ["epsilon", "non_private", "delta", "l2_clip", "normalize", "hist_noise_multiplier", "seed"],
    "model": ["model", "k", "history", "d", "heads", "blocks", "norm", "ffn_dim", "item_dim", "dropout",
              "item_init", "item_init_k", "item_init_noise", "transition_prior", "freeze_item_table",
              "trainable_items"],
    "training": ["epochs", "batch_size", "lr", "weight_decay", "warmup_frac", "optimizer", "adam_bc_gamma", "negatives",
                 "negative_sampler", "sparse_item_rows", "sparse_ratio", "sparse_threshold"],
    "evaluation": ["eval_every", "mask_history"],
    "speed and memory (no effect on the results)": ["clipping", "chunk_rows", "length_buckets"],
    "long runs, progress and output": ["checkpoint", "resume", "max_minutes", "max_steps", "time_limit",
                                       "no_progress", "show_private_diagnostics", "out", "plot"],
}


BASELINE_TEXT = {"zero_cost": "zero-cost baseline (each user's own recent items, nothing released)",
                 "popularity": "popularity baseline (the most popular items by the counts the run released or the "
                               "caller declared public: no further privacy cost)"}


def baseline_warnings(metrics: dict, baselines: dict) -> list[str]:
    """One warning per baseline whose test NDCG@10 the model does not beat: what users get without the model."""
    ours = metrics.get("ndcg_at_10_test")
    out = []
    for name, m in baselines.items():
        theirs = m.get("ndcg_at_10_test")
        if ours is not None and theirs is not None and ours < theirs:
            out.append(f"the model (test NDCG@10 {ours:.4%}) is worse than the "
                       f"{BASELINE_TEXT.get(name, name + ' baseline')}: {theirs:.4%}")
    return out


QUICK_XLA_FLAGS = "--xla_backend_optimization_level=1"


def quick_compile_flags() -> bool:
    """The quick first run (`--data synthetic`, default epochs: 16 steps) spends most of its time compiling, so
    it asks XLA's backend for less optimisation. Measured on a 2-core CPU, first runs without the compilation
    cache, 4 interleaved runs each: 10.9 s → 10.0 s wall (first step 4.7 → 3.9 s), the same time per step
    (0.10 s); `--xla_llvm_disable_expensive_passes` added nothing, level 0 runs each step 3× slower. Only when
    the caller set no XLA_FLAGS (called before the first computation: XLA reads them when its backend
    starts); returns whether it set them."""
    if "XLA_FLAGS" in os.environ:
        return False
    os.environ["XLA_FLAGS"] = QUICK_XLA_FLAGS
    return True


def _train_config(args: argparse.Namespace, maxlen: int) -> TrainConfig:
    """The TrainConfig of the flags (defaults by dataset: the quick synthetic run, the papers' otherwise) for windows
    of `maxlen` items."""
    movielens = args.data in ("ml-100k", "ml-1m")
    synthetic = args.data == "synthetic"
    # the quick run: no dropout (2 epochs on a planted first-order rule: a regulariser only slows it down, and
    # its per-user masks double the step's compilation); width 32 at lr 8e-2 (first runs on a 2-core CPU, 3 pairs:
    # 7.5-7.7 s vs 8.3-9.2 s at width 64 and lr 3e-2; test NDCG@10 0.61-0.63 vs 0.61-0.62, seeds 1-3, lr from
    # validation over {3e-2, 5e-2, 8e-2, 1.2e-1})
    dropout = args.dropout if args.dropout is not None else (0.2 if movielens else 0.0 if synthetic else None)
    epochs = args.epochs if args.epochs is not None else (2.0 if synthetic else 100.0)
    lr = args.lr if args.lr is not None else (8e-2 if synthetic else 1e-3)
    batch_size = args.batch_size if args.batch_size is not None else (256 if synthetic else 1024)
    chunk_rows = (args.chunk_rows if args.chunk_rows is not None
                  else int(1.25 * batch_size) * maxlen if synthetic else TrainConfig.chunk_rows)
    buckets = (args.length_buckets if args.length_buckets is not None
               else "" if synthetic else ",".join(map(str, DEFAULT_WINDOWS)))
    try:
        windows = tuple(int(b) for b in buckets.split(",") if b.strip())
    except ValueError:
        raise ValueError(f"--length-buckets must be comma-separated integers, got {buckets!r}") from None
    return TrainConfig(model=args.model, epsilon=_epsilon(args), delta=args.delta,
                       epochs=epochs, batch_size=batch_size, lr=lr, warmup_frac=args.warmup_frac,
                       weight_decay=args.weight_decay, optimizer=args.optimizer, adam_bc_gamma=args.adam_bc_gamma,
                       sparse_item_rows=args.sparse_item_rows, sparse_ratio=args.sparse_ratio,
                       sparse_threshold=args.sparse_threshold,
                       l2_clip=args.l2_clip, normalize=args.normalize,
                       d=args.d if args.d is not None else (32 if synthetic else 64),
                       heads=args.heads, blocks=args.blocks if args.blocks is not None else (1 if synthetic else 2),
                       dropout=dropout, norm=args.norm, ffn_dim=args.ffn_dim, item_dim=args.item_dim,
                       chunk_rows=chunk_rows, clipping=args.clipping, hist_noise_multiplier=args.hist_noise_multiplier,
                       eval_every_epochs=args.eval_every, mask_history=args.mask_history, length_buckets=windows,
                       n_users_public=args.n_users, negatives=args.negatives,
                       negative_sampler=args.negative_sampler, trainable_items=args.trainable_items,
                       item_init=args.item_init, item_init_k=args.item_init_k, item_init_noise=args.item_init_noise,
                       freeze_item_table=args.freeze_item_table, transition_prior=args.transition_prior,
                       # the quick run's one small chunk in one pass: ~1.5 s less tracing and compiling
                       batch_chunk=None if synthetic else TrainConfig.batch_chunk)


def _epsilon(args: argparse.Namespace) -> float | None:
    """ε of the run: None for --non-private, else --epsilon (default `DEFAULT_EPSILON`)."""
    return None if args.non_private else DEFAULT_EPSILON if args.epsilon is None else args.epsilon


def check_args(args: argparse.Namespace) -> None:
    """Every option that can be checked without the data, before any work (reading or generating the data, drawing
    the seed); refusals name the flags."""
    from jdp.seqrec import data as data_mod
    if args.non_private and args.epsilon is not None:
        raise ValueError(f"--epsilon {args.epsilon:g} would be ignored by --non-private (no noise, no guarantee): "
                         "drop one of them")
    check_at_least(args, {"k": 1, "history": 1, "maxlen": 1, "d": 1, "heads": 1, "blocks": 1, "ffn_dim": 1,
                          "item_dim": 1, "batch_size": 1, "chunk_rows": 1, "negatives": 0, "trainable_items": 0,
                          "item_init_k": 1, "n_users": 1, "max_steps": 1})
    if args.time_limit is not None and not args.time_limit > 0:
        raise ValueError(f"--time-limit must be > 0, got {args.time_limit}")
    # the one privacy rule with the flags' names; δ < 1/n here when --n-users declares n, else once the data are read
    check_flag_privacy(_epsilon(args), args.delta, args.n_users, unit="user")
    if args.resume and not args.checkpoint:
        raise ValueError("--resume needs --checkpoint")
    if args.checkpoint and pathlib.Path(args.checkpoint).exists() and not args.resume:
        raise ValueError(f"--checkpoint {args.checkpoint} exists: pass --resume to continue it, or remove it")
    if args.resume and not pathlib.Path(args.checkpoint).is_file():
        raise ValueError(f"--resume: the checkpoint {args.checkpoint} does not exist (nothing to continue)")
    for flag, path in (("--public-item-counts", args.public_item_counts), ("--item-catalogue", args.item_catalogue)):
        if path and not pathlib.Path(path).exists():
            raise ValueError(f"{flag}: {path} does not exist")
    if args.model != "transitions":
        maxlen = args.maxlen if args.maxlen is not None else (
            data_mod.MOVIELENS_MAXLEN if args.data in ("ml-100k", "ml-1m") else
            data_mod.SYNTHETIC_MAXLEN if args.data == "synthetic" else data_mod.AMAZON_MAXLEN)
        with flag_names(FLAGS):
            _train_config(args, maxlen).validate()


def run(args: argparse.Namespace) -> int:
    import jax

    from jdp.seqrec.train import train

    logging.getLogger("absl").setLevel(logging.ERROR)
    _refuse_before_any_work(args)
    check_args(args)
    if args.data == "synthetic" and args.epochs is None and args.model != "transitions":
        quick_compile_flags()
    t0 = time.perf_counter()
    seed = noise_seed(args)
    k_train = jax.random.key(seed)
    d = _load(args, jax.random.fold_in(k_train, 0x766F63))  # the vocabulary's own stream; training keeps key(seed)
    # δ < 1/N of the declared users (--n-users), else of the users read: refused with the flag's name before training
    check_flag_privacy(_epsilon(args), args.delta, args.n_users or d.n_users, unit="user")
    t_load = time.perf_counter() - t0
    if args.model == "transitions":
        return _run_transitions(args, d, k_train, seed, t_load)
    with flag_names(FLAGS):
        cfg = _train_config(args, d.maxlen)
    public = None
    if args.public_item_counts:
        public = np.load(args.public_item_counts)
    with flag_names(FLAGS):
        res = train(d, cfg, k_train, public_item_counts=public, checkpoint=args.checkpoint,
                    progress=not args.no_progress, max_steps=args.max_steps,
                    max_seconds=args.time_limit, show_private_diagnostics=args.show_private_diagnostics,
                    time_budget_s=None if args.max_minutes is None else 60.0 * args.max_minutes)
    prior = bool(res.reatt and "prior_slot" in res.reatt)
    out = {
        "data": args.data, **({"data_seed": args.data_seed} if args.data == "synthetic" else {}), "model": args.model, "epsilon": cfg.epsilon, "delta": cfg.delta, "seed": seed,
        "device": jax.devices()[0].device_kind, "xla_flags": os.environ.get("XLA_FLAGS"), "n_users": d.n_users, "n_items": d.n_items, "maxlen": d.maxlen,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()},
        "noise_multiplier": res.noise_multiplier, "steps": res.steps,
        "vocabulary": args.vocabulary, "vocabulary_assumptions": list(d.vocab_assumptions),
        "transition_prior": prior,  # as resolved (`uses_transition_prior`)
        "dropout": cfg.dropout_rate(prior),  # as resolved
        "item_counts": "public (caller-declared)" if public is not None else (
            "DP histogram" if res.item_counts_released is not None else None),
        "evaluation": {"ranking": "full (all items, padding excluded)", "history_masked": cfg.mask_history},
        "metrics": res.metrics, "baselines": res.baselines, "history": res.history,
        "privacy": res.privacy.to_dict() if res.privacy is not None else {"non_private": True, "epsilon": None},
        "timings": {**res.timings, "load_s": t_load},
    }
    from jdp.plots import seqrec_history
    return _report(args, out, res.privacy, seqrec_history)


def _refuse_before_any_work(args: argparse.Namespace) -> None:
    """Flags that do not go together, or a given input that would be ignored: ValueError naming them."""
    if args.max_minutes is not None:
        if not args.max_minutes > 0:
            raise ValueError(f"--max-minutes must be > 0, got {args.max_minutes}")
        if args.model == "transitions":
            raise ValueError("--max-minutes does not apply to --model transitions (one release, no training loop)")
        if not args.checkpoint:
            raise ValueError("--max-minutes stops training early and saves it for --resume: give --checkpoint FILE")
    if args.model == "transitions":
        if args.k is None and args.non_private:
            raise ValueError("--model transitions --non-private needs --k (the rule for K reads the release's noise)")
        if args.mask_history or args.checkpoint or args.resume:
            raise ValueError("--mask-history, --checkpoint and --resume do not apply to --model transitions")
    # a given data input is never ignored (the rule of `jdp altmin` too): refused where it does not apply
    if args.data == "synthetic" and (args.data_path or args.data_sha256):
        given = " and ".join(f for f, v in (("--data-path", args.data_path), ("--data-sha256", args.data_sha256)) if v)
        raise ValueError(f"--data synthetic generates its sequences and reads no file, so {given} would be ignored: "
                         f"drop it, or name the dataset your file holds (--data amazon-games / ml-100k / ml-1m)")
    if args.data_path and args.data_sha256:
        raise ValueError(f"--data-sha256 checks a download, but --data-path {args.data_path} downloads nothing: "
                         "drop one of them")


def _load(args: argparse.Namespace, k_vocab):
    """The named dataset (downloaded unless --data-path; generated for synthetic) with its item vocabulary."""
    from jdp.seqrec import data as data_mod
    path = args.data_path
    if path is None and args.data != "synthetic":
        from jdp.data import fetch
        path = fetch(args.data, args.data_dir, progress=not args.no_progress, sha256=args.data_sha256)
    catalogue = None
    if args.item_catalogue:
        cp = pathlib.Path(args.item_catalogue)
        if cp.suffix == ".npy":
            catalogue = np.load(cp)
        elif cp.name in ("u.item", "movies.dat", "movies.csv") or cp.is_dir():
            from jdp.data.movielens import load_movielens_items
            catalogue = load_movielens_items(cp)
        else:
            catalogue = np.loadtxt(cp, dtype=np.int64, ndmin=1)
    with flag_names(FLAGS):
        return data_mod.load(args.data, path=path, maxlen=args.maxlen, vocabulary=args.vocabulary,
                             item_catalogue=catalogue, min_item_count=args.min_item_count,
                             vocab_noise_multiplier=args.vocab_noise_multiplier, key=k_vocab, delta=args.delta,
                             data_seed=args.data_seed)


METRIC_UNITS = ("NDCG@10 and HIT@10 are fractions in [0, 1] in this file (the printed summary shows them as "
                "percentages)")


def _pct(metrics: dict, key: str) -> str:
    value = metrics.get(key)
    return "n/a" if value is None else f"{100 * value:.2f}%"


def _report(args: argparse.Namespace, out: dict, privacy, plot) -> int:
    """Writes `--out` (JSON) and `--plot` (with `plot(out, path)`) first, so that a closed pipe cannot lose them,
    then prints the summary: data, where training stopped, test / validation NDCG@10 and HIT@10 in percent, the
    baselines, the privacy report and a warning for each baseline the model does not beat."""
    out["metric_units"] = METRIC_UNITS
    privacy_dict = out.get("privacy") or {}
    if privacy_dict.get("assumptions"):  # the library names its argument; a command-line user sets the flag
        privacy_dict["assumptions"] = [a.replace("TrainConfig(n_users_public=...)", "--n-users N")
                                       for a in privacy_dict["assumptions"]]
    warnings = baseline_warnings(out["metrics"], out["baselines"])
    if warnings:
        out.setdefault("warnings", []).extend(warnings)
    wrote = []
    if args.out:
        wrote.append(write_result(args.out, out))
    if args.plot:
        wrote.append(f"wrote {plot(out, args.plot)}")
    m, t = out["metrics"], out.get("timings", {})
    source = "GENERATED (--data-seed %d)" % out["data_seed"] if out["data"] == "synthetic" else "read from file"
    summary = [f"data: {out['data']}, {source}: {out['n_users']:,} users, {out['n_items']:,} items, windows of the "
               f"last {out['maxlen']} items"]
    if "steps_done" in t:
        what = f"{out['model']}: {t['steps_done']} of {out['steps']} steps ({t['epochs_done']:.2f} epochs), " \
               f"{t.get('train_s', 0.0):.1f} s training ({t.get('s_per_step', 0.0):.3g} s per step)"
        summary.append(what + ("" if out.get("noise_multiplier") is None or out["epsilon"] is None
                               else f", noise multiplier {out['noise_multiplier']:.4g}"))
    else:
        summary.append(f"{out['model']}: one release, fitted in {t.get('fit_s', 0.0):.1f} s")
    stopped = t.get("stopped")
    if stopped:
        where = "an epoch boundary" if stopped.get("at_epoch_boundary") else "mid-epoch"
        why = {"time budget": f"--max-minutes {args.max_minutes:g}" if getattr(args, "max_minutes", None) else
               "the time budget", "max_steps": "--max-steps"}.get(stopped["reason"], "--time-limit")
        resume = (f"checkpoint {stopped['checkpoint']}: the same command with --resume continues it"
                  if stopped.get("checkpoint") else "no --checkpoint: it cannot be continued")
        summary.append(f"STOPPED by {why} at step {stopped['step']} of {stopped['planned_steps']} (epoch "
                       f"{stopped['epoch']:.2f}, {where}); {resume}. The privacy report covers the steps that ran.")
    summary.append(f"test NDCG@10 {_pct(m, 'ndcg_at_10_test')}  HIT@10 {_pct(m, 'hit_at_10_test')}   "
                   f"(validation NDCG@10 {_pct(m, 'ndcg_at_10_valid')}  HIT@10 {_pct(m, 'hit_at_10_valid')}; "
                   f"full ranking of all items)")
    for name, b in out["baselines"].items():
        what = ("each user's own recent items, nothing released" if name == "zero_cost"
                else "items by the released / public counts, no further release")
        summary.append(f"baseline {name} ({what}): test NDCG@10 {_pct(b, 'ndcg_at_10_test')}  "
                       f"HIT@10 {_pct(b, 'hit_at_10_test')}")
    summary += privacy_lines(out["privacy"]) + [f"WARNING: {w}" for w in warnings] + wrote + no_out_hint(args)
    print("\n".join(summary))
    return 0


def _run_transitions(args: argparse.Namespace, d, key, seed: int, t_load: float) -> int:
    """`--model transitions`: one release (`jdp.seqrec.transitions.fit`), evaluated like the trained models."""
    from jdp.seqrec import evaluate as E
    from jdp.seqrec import transitions as T
    public = np.load(args.public_item_counts) if args.public_item_counts else None
    t0 = time.perf_counter()
    model = T.fit(d, _epsilon(args), args.delta, args.k, key, history=args.history,
                  public_item_counts=public)
    fit_s = time.perf_counter() - t0
    mv, mt = model.evaluate(d.valid_input, d.valid_target), model.evaluate(d.test_input, d.test_target)
    metrics = {"ndcg_at_10_valid": mv["ndcg"], "hit_at_10_valid": mv["hit"], "n_valid_users": mv["n_users"],
               "ndcg_at_10_test": mt["ndcg"], "hit_at_10_test": mt["hit"], "n_test_users": mt["n_users"]}
    # popularity from the release or declared counts only (the non-private reference's counts are exact)
    baselines = E.baseline_metrics(d, public if public is not None else model.counts if model.report else None)
    out = {"data": args.data, **({"data_seed": args.data_seed} if args.data == "synthetic" else {}),
           "model": "transitions", "epsilon": _epsilon(args), "delta": args.delta,
           "seed": seed, "n_users": d.n_users, "n_items": d.n_items, "maxlen": d.maxlen, "k": int(model.items.size),
           "k_rule": args.k is None,
           "history": args.history, "noise_multiplier": model.noise_multiplier,
           "vocabulary": args.vocabulary, "vocabulary_assumptions": list(d.vocab_assumptions),
           "evaluation": {"ranking": "full (all items, padding excluded)", "history_masked": False},
           "metrics": metrics, "baselines": baselines,
           "privacy": model.report.to_dict() if model.report is not None else {"non_private": True, "epsilon": None},
           "timings": {"load_s": t_load, "fit_s": fit_s}}
    from jdp.plots import seqrec_release
    return _report(args, out, model.report, seqrec_release)


__all__ = ["baseline_warnings", "register", "run"]
