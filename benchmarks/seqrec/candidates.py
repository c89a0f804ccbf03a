"""DP-SGD Transformers on a candidate vocabulary: does a small item table escape the popularity plateau?

    PYTHONPATH=. python -m benchmarks.seqrec.candidates [--model dpformer] [--k 500] [--epsilon 8] [--epochs 20]
        [--freeze-table] [--data-dir DIR] [--out NAME]

A diagnostic beyond the paper (benchmarks/seqrec/README.md). The item vocabulary of the model is cut to the K items
with the largest released popularity (each user's distinct items weighted 1/sqrt(their number), L2 sensitivity 1,
noise std 4: the release `jdp.seqrec.transitions` uses); every other item enters the model as one shared "other"
token and is never a training target (its positions carry no loss). The release is composed with the DP-SGD steps
in one PrivacyReport of total ε (σ calibrated for both), and Re-Attention reads the released counts. Evaluation
ranks every item: a held-out target outside the candidates ranks after all K of them, so it scores 0 at @10 (K ≥
10); the metrics below are over ALL evaluated users. Also reported: the popularity ranking of the same release.
`--freeze-table`: the item table is not differentiated (stop_gradient: no clipping budget is spent on it and no
signal reaches it), so it keeps its random initialisation up to the optimizer's steps on the DP noise alone
(Adam's noise walk, about 0.3 per 64-wide row over 20 epochs against row norms near 1): a diagnostic of a body
trained on item codes that carry no learned information. With `--model transformer-untied` that is the input
table only: the output layer (weights and per-item bias) still trains.
The committed protocol otherwise (normalised clipping C = 1, B 1024, lr 3e-3, 20% warm-up, d 64, dropout 0.5).
"""
from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from benchmarks.common import write_results
from jdp import accounting, noise
from jdp.data import fetch
from jdp.seqrec import data as D
from jdp.seqrec import item_table
from jdp.seqrec import prepare as P
from jdp.seqrec import train as T
from jdp.seqrec import transitions as TR
from jdp.seqrec.evaluate import ndcg_hit_from_ranks, popularity_ranks

DELTA = 1e-5
HIST_NOISE = 4.0


def candidate_data(data: D.SeqData, counts: np.ndarray, k: int, releases: tuple) -> tuple[D.SeqData, np.ndarray]:
    """`data` re-indexed to the top-k items of `counts` (ids 1..k, k+1 = every other item as an input token;
    targets outside the candidates become 0 = no loss / not evaluated), and the map old id -> new id."""
    M = data.n_items
    remap = np.full(M + 1, k + 1, np.int32)
    remap[0] = 0
    remap[TR._top(counts, k)] = np.arange(1, k + 1)

    def target(t):
        t = remap[t]
        return np.where(t == k + 1, 0, t)
    new = D.SeqData(k + 1, data.maxlen, remap[data.train_input], target(data.train_target), remap[data.valid_input],
                    target(data.valid_target), remap[data.test_input], target(data.test_target),
                    vocab_releases=tuple(data.vocab_releases) + tuple(releases),
                    vocab_assumptions=data.vocab_assumptions)
    return new, remap


def freeze_table_loss(make_loss_fn):
    """make_loss_fn whose losses do not differentiate the item table (`jdp.seqrec.item_table.freeze_item_table_loss`);
    unlike TrainConfig(freeze_item_table=True) the optimizer still moves the table by the noise (the diagnostic
    as it ran)."""
    def make(model, log_q=None):
        return item_table.freeze_item_table_loss(make_loss_fn(model, log_q=log_q))
    return make


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dpformer", choices=["dpformer", "transformer", "transformer-untied"])
    ap.add_argument("--k", type=int, default=500)
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--epochs", type=float, default=20.0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--freeze-table", action="store_true")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    data = D.load("amazon-games", path=fetch("amazon-games", args.data_dir))
    M, K = data.n_items, args.k
    k_hist, k_train = jax.random.split(jax.random.key(args.seed))
    release = accounting.PrivacyReport(DELTA, unit="user", relation=accounting.ADD_OR_REMOVE_ONE)
    release.add_gaussian("item popularity (per-user norm 1)", sensitivity=1.0, noise_std=HIST_NOISE)
    counts = noise.gaussian_histogram(k_hist, TR.normalized_presence(
        TR.user_sequences(data.train_input, data.train_target), M), HIST_NOISE)
    counts[0] = 0.0
    cand, remap = candidate_data(data, counts, K, tuple(release.releases))
    # DPFormer's Re-Attention reads the same release (post-processing); the "other" token gets the rest's sum
    public = np.zeros(K + 2)
    is_cand = (remap >= 1) & (remap <= K)
    public[remap[is_cand]] = np.maximum(counts[is_cand], 0.0)
    public[K + 1] = max(np.maximum(counts[remap == K + 1], 0.0).sum(), 1.0)
    if args.freeze_table:
        P.make_loss_fn = freeze_table_loss(P.make_loss_fn)  # the loss `train` builds
    cfg = T.TrainConfig(model=args.model, epsilon=args.epsilon, delta=DELTA, epochs=args.epochs, batch_size=1024,
                        lr=args.lr, normalize=True, eval_every_epochs=2.0,
                        clipping="vmap" if args.freeze_table else "auto", item_init="random")
    t0 = time.perf_counter()
    res = T.train(cand, cfg, k_train, public_item_counts=public if args.model == "dpformer" else None,
                  progress=False)
    n_valid, n_test = int((data.valid_target > 0).sum()), int((data.test_target > 0).sum())
    m = res.metrics
    scale_v, scale_t = m["n_valid_users"] / n_valid, m["n_test_users"] / n_test  # other users score 0 at @10
    pop = {}
    for split, t in (("valid", data.valid_target), ("test", data.test_target)):
        r = ndcg_hit_from_ranks(popularity_ranks(t[t > 0], counts))
        pop.update({f"ndcg_at_10_{split}": r["ndcg"], f"hit_at_10_{split}": r["hit"]})
    row = {"model": args.model, "k": K, "epsilon": args.epsilon, "epochs": args.epochs, "lr": args.lr,
           "seed": args.seed, "freeze_table": args.freeze_table, "noise_multiplier": res.noise_multiplier,
           "report_epsilon": res.privacy.epsilon(),
           "candidate_share_of_test_targets": scale_t,
           "ndcg_at_10_valid": m["ndcg_at_10_valid"] * scale_v, "hit_at_10_valid": m["hit_at_10_valid"] * scale_v,
           "ndcg_at_10_test": m["ndcg_at_10_test"] * scale_t, "hit_at_10_test": m["hit_at_10_test"] * scale_t,
           "ndcg_at_10_test_candidate_users": m["ndcg_at_10_test"],
           "popularity_of_release": pop,
           "history": [{**h, **({"ndcg_at_10_valid": h["ndcg_at_10_valid"] * scale_v}
                                if "ndcg_at_10_valid" in h else {})} for h in res.history],
           "s_per_step": res.timings["s_per_step"], "seconds": time.perf_counter() - t0}
    print({k: v for k, v in row.items() if k != "history"}, flush=True)
    name = args.out or f"seqrec_candidates_{args.model}_k{K}_eps{args.epsilon:g}" + ("_frozen" if args.freeze_table
                                                                                     else "")
    write_results(name, [row])


if __name__ == "__main__":
    main()
