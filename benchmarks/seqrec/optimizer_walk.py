"""How far each optimiser moves an item row when DP-SGD's noise dominates its gradient (issue: the Transformers'
popular rows stay near their random start while Adam "normalises the noise away").

    PYTHONPATH=. python -m benchmarks.seqrec.optimizer_walk [--steps 606 3029] [--rows 4000]

Rows of 64 coordinates receive g̃ = s·u + z per step: z ~ N(0, φ) the noise of `dp_aggregate`'s mean
(φ = (σC/B)², σ = 0.868, C = 1, B = 1,024: the 20-epoch Amazon Games protocol at ε = 8) and a fixed unit-norm
direction u scaled to a signal-to-noise s/√φ per row (0: pure noise; 0.1, 1 per coordinate·√64 …). Measured after
606 steps (20 epochs) and 3,029 (100 epochs) of seqrec's schedule (lr 3e-3, 20% linear warm-up then linear decay):
the RMS distance a row moved (its noise walk) and its movement along u (the signal it followed), per optimiser:
Adam (seqrec's adamw, weight decay 1e-5), DP-AdamBC (`jdp.clipping.dp_adam_bc`) at γ = 1, 10, 100 φ, and SGD with
momentum 0.9 at the lr that moves a coordinate whose gradient equals the noise std as far as Adam does. No data: the gradients are synthetic.
Writes benchmarks/seqrec/results/seqrec_optimizer_walk.json.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import write_results
from jdp.clipping import dp_adam_bc, noise_variance

SIGMA, CLIP, BATCH, LR, WARMUP, DIM = 0.868, 1.0, 1024, 3e-3, 0.2, 64


def schedule(lr: float, steps: int) -> optax.Schedule:
    warm = max(1, int(WARMUP * steps))
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warm),
                                 optax.linear_schedule(lr, 0.0, max(1, steps - warm))], [warm])


def optimisers(steps: int, phi: float) -> dict[str, optax.GradientTransformation]:
    # SGD with momentum β = 0.9 moves a coordinate with a constant gradient g by lr·g/(1-β) per step, Adam by lr:
    # lr_sgd = lr_adam·(1-β)/√φ makes them equal where g equals the noise std √φ
    return {
        "adam": optax.adamw(schedule(LR, steps), weight_decay=1e-5),
        **{f"adam_bc_gamma{g:g}": dp_adam_bc(schedule(LR, steps), phi, gamma_over_noise=g, weight_decay=1e-5)
           for g in (1.0, 10.0, 100.0)},
        "sgd_momentum": optax.sgd(schedule(LR * 0.1 / np.sqrt(phi), steps), momentum=0.9),
    }


def walk(tx: optax.GradientTransformation, steps: int, phi: float, snr: float, rows: int, seed: int) -> dict:
    """RMS row distance from the start and mean movement along the signal direction (against the gradient)."""
    u = jnp.ones(DIM) / jnp.sqrt(DIM)
    signal = snr * jnp.sqrt(phi * DIM) * u          # row-norm signal-to-noise `snr` (noise norm √(64 φ))
    params = jnp.zeros((rows, DIM))
    state = tx.init(params)

    def body(carry, key):
        p, s = carry
        g = signal + jnp.sqrt(phi) * jax.random.normal(key, p.shape)
        upd, s = tx.update(g, s, p)
        return (optax.apply_updates(p, upd), s), None

    (params, _), _ = jax.lax.scan(body, (params, state), jax.random.split(jax.random.PRNGKey(seed), steps))
    dist = jnp.sqrt(jnp.sum(params ** 2, axis=1))
    return {"rms_distance": float(jnp.sqrt(jnp.mean(dist ** 2))), "along_signal": float(-jnp.mean(params @ u))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, nargs="+", default=[606, 3029])
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--snrs", type=float, nargs="+", default=[0.0, 0.1, 1.0])
    args = ap.parse_args(argv)
    phi = noise_variance(SIGMA, CLIP, BATCH)
    rows = []
    for steps in args.steps:
        for name, tx in optimisers(steps, phi).items():
            for snr in args.snrs:
                r = {"steps": steps, "optimizer": name, "snr_per_row": snr,
                     **walk(tx, steps, phi, snr, args.rows, seed=0)}
                rows.append(r)
                print(f"{steps:5d} {name:18s} snr {snr:4.1f}: walk {r['rms_distance']:.3f} "
                      f"along signal {r['along_signal']:+.3f}", flush=True)
    path = write_results("seqrec_optimizer_walk", rows, noise_std=float(np.sqrt(phi)), sigma=SIGMA, clip=CLIP,
                         batch=BATCH, lr=LR, dim=DIM)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
