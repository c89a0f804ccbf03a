"""Signal against DP-SGD noise per parameter group (item table, positions, body) for each seqrec model.

    PYTHONPATH=. python -m benchmarks.seqrec.grad_snr [--data-dir DIR] [--epochs 2] [--sigma 1.37]

A diagnostic for why the private Transformers stay at the popularity level while the GRU / LSTM do not. For a
fixed sample of B = 1024 Amazon Games users: each user's exact gradient (vmap, no dropout), normalised to norm 1
(the paper's normalised clipping, C = 1); their mean s is DP-SGD's noise-free update, to which DP-SGD adds
N(0, (σ/B)² I) (σ = 1.37: ε = 8, 100 epochs, B 1024). Per group: the mean share of a user's squared gradient norm,
‖s_group‖, the noise norm σ/B·√P_group and their ratio (signal-to-noise of one step). At initialisation and after
`--epochs` NON-PRIVATE epochs (a model that has started to learn; lr 3e-3, B 1024). Writes
benchmarks/seqrec/results/seqrec_grad_snr.json.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import write_results
from jdp.data import fetch
from jdp.seqrec import data as D
from jdp.seqrec import models, train

VARIANTS = {"gru": {"model": "gru"}, "lstm": {"model": "lstm"},
            "transformer (pre-LN, FFN d)": {"model": "transformer"},
            "transformer (post-LN, FFN 4d)": {"model": "transformer", "norm": "post", "ffn_dim": 256}}


def _group(path) -> str:
    s = "/".join(str(getattr(k, "key", k)) for k in path)
    return "item_embed" if "item_embed" in s else "pos_embed" if "pos_embed" in s else "body"


def group_snr(model, params, inputs, targets, sigma: float, chunk: int = 32) -> dict:
    """Per group: P, mean share of the per-user squared norm, ‖mean normalised gradient‖, noise norm, ratio."""
    loss_fn = models.make_loss_fn(model, deterministic=True)
    key = jax.random.split(jax.random.key(0), 1)

    def unit_grad(p, x, y):
        g = jax.grad(lambda p: loss_fn(p, {"input": x[None], "target": y[None], "key": key})[0])(p)
        norm = jnp.sqrt(sum(jnp.sum(leaf * leaf) for leaf in jax.tree_util.tree_leaves(g)))
        return jax.tree_util.tree_map(lambda leaf: leaf / jnp.maximum(norm, 1e-12), g)

    @jax.jit
    def chunk_sums(p, x, y):
        g = jax.vmap(unit_grad, (None, 0, 0))(p, x, y)
        sq = jax.tree_util.tree_map(lambda leaf: jnp.sum(leaf.reshape(leaf.shape[0], -1) ** 2, 1).sum(), g)
        return jax.tree_util.tree_map(lambda leaf: leaf.sum(0), g), sq

    B = inputs.shape[0]
    total = sq_total = None
    for i in range(0, B, chunk):
        s, sq = chunk_sums(params, inputs[i:i + chunk], targets[i:i + chunk])
        total = s if total is None else jax.tree_util.tree_map(jnp.add, total, s)
        sq_total = sq if sq_total is None else jax.tree_util.tree_map(jnp.add, sq_total, sq)
    groups: dict = {}
    for (path, leaf), (_, sq) in zip(jax.tree_util.tree_flatten_with_path(total)[0],
                                     jax.tree_util.tree_flatten_with_path(sq_total)[0]):
        g = groups.setdefault(_group(path), {"params": 0, "share": 0.0, "signal_sq": 0.0})
        g["params"] += int(leaf.size)
        g["share"] += float(sq) / B
        g["signal_sq"] += float(jnp.sum((leaf / B) ** 2))
    for g in groups.values():
        g["signal"] = g.pop("signal_sq") ** 0.5
        g["noise"] = sigma / B * g["params"] ** 0.5
        g["snr"] = g["signal"] / g["noise"]
    return groups


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--sigma", type=float, default=1.37)
    ap.add_argument("--users", type=int, default=1024)
    args = ap.parse_args(argv)
    data = D.load("amazon-games", path=fetch("amazon-games", args.data_dir))
    idx = np.sort(np.random.default_rng(0).choice(data.n_users, args.users, replace=False))
    inputs, targets = jnp.asarray(data.train_input[idx]), jnp.asarray(data.train_target[idx])
    rows = []
    for name, kw in VARIANTS.items():
        for epochs in (0.0, args.epochs):
            t0 = time.perf_counter()
            cfg = train.TrainConfig(epsilon=None, epochs=max(epochs, 0.01), batch_size=1024, lr=3e-3,
                                    normalize=True, dropout=0.5, **kw)
            res = train.train(data, cfg, jax.random.key(0), progress=False, max_steps=0 if epochs == 0 else None)
            model = models.make_model(cfg.model, data.n_items, data.maxlen, dropout=0.0, norm=cfg.norm,
                                      ffn_dim=cfg.ffn_dim)
            groups = group_snr(model, res.params, inputs, targets, args.sigma)
            rows.append({"model": name, "nonprivate_epochs": epochs, "groups": groups,
                         "ndcg_at_10_valid": res.metrics.get("ndcg_at_10_valid"), "seconds": time.perf_counter() - t0})
            print(name, epochs, {k: round(v["snr"], 4) for k, v in groups.items()}, flush=True)
    path = write_results("seqrec_grad_snr", rows, sigma=args.sigma, users=args.users)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
