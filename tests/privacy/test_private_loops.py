"""Private loops have no data-dependent control flow (issue #69, item 5).

A sampled unit whose loss or gradient is not finite contributes nothing to its step's clipped sum, so the
sensitivity bound holds and the step is the accounted mechanism. The loop must then go on: raising (or
stopping) at that step would release, outside the report, whether and when that unit was sampled. Worst
input: one row whose label (1e20) makes its squared loss overflow to inf, or one user whose sequence holds
an item whose input embedding is NaN. Each run completes the same number of steps as its neighbour without
that unit, and the dropped unit is counted in a private diagnostic returned beside the result.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp.clipping as jc

N, D = 16, 3


def _loss(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    return (pred - batch["y"]) ** 2  # a label of 1e20: (1e20)^2 overflows float32 to inf


def _data(seed: int, n: int = N):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5]) + 0.1 * rng.normal(size=n)).astype(np.float32)
    return {"x": jnp.asarray(x), "y": jnp.asarray(y)}


def _params():
    return {"w": jnp.zeros(D, jnp.float32), "b": jnp.zeros((), jnp.float32)}


def _dp(num_examples: int, steps: int = 8, max_batch_size: int | None = None):
    # the rate is fixed (q = 1/2 of the declared N) so a dataset and its neighbour run the same mechanism
    return jc.dp_sgd(_loss, optax.sgd(0.05), num_examples=num_examples, batch_size=num_examples / 2, l2_clip=1.0,
                     delta=1e-5, steps=steps, noise_multiplier=1.0, max_batch_size=max_batch_size)


def _sampled(dp, key, steps):
    """Per step, the rows of the Poisson sample `fit` draws (its sampling key is the second half of `key`)."""
    _, k_sample = jax.random.split(key)
    out = []
    for t in range(steps):
        idx, mask = dp.sample(jax.random.fold_in(k_sample, t))
        out.append(set(np.asarray(idx)[np.asarray(mask)].tolist()))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dp_sgd_fit_runs_every_step_with_a_nonfinite_row_and_counts_it(seed):
    data = _data(seed)
    bad = {"x": data["x"], "y": data["y"].at[0].set(1e20)}
    neighbour = jax.tree.map(lambda a: a[1:], data)
    key = jax.random.PRNGKey(seed)
    dp = _dp(N)
    sampled = _sampled(dp, key, dp.steps)
    assert any(0 in s for s in sampled), "the test needs the bad row sampled at least once"

    params, report, history = dp.fit(_params(), bad, key, progress=False)
    p_nb, report_nb, history_nb = _dp(N - 1).fit(_params(), neighbour, key, progress=False)

    assert len(history) == len(history_nb) == dp.steps
    assert report.releases[0].count == report_nb.releases[0].count == dp.steps
    # the diagnostic counts exactly the dropped row, at exactly the steps that sampled it
    assert [int(h["num_nonfinite"]) for h in history] == [int(0 in s) for s in sampled]
    assert sum(h["num_nonfinite"] for h in history_nb) == 0
    assert all(np.all(np.isfinite(np.asarray(v))) for v in jax.tree.leaves(params))
    assert all(np.all(np.isfinite(np.asarray(v))) for v in jax.tree.leaves(p_nb))


def test_dp_sgd_fit_with_a_nonfinite_row_prints_nothing_private(capsys):
    data = _data(3)
    bad = {"x": data["x"], "y": data["y"].at[0].set(np.inf)}
    _, _, history = _dp(N, steps=4).fit(_params(), bad, jax.random.PRNGKey(3), progress=False)
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    assert len(history) == 4


def test_an_oversized_poisson_sample_is_processed_whole_never_raised_or_truncated():
    """Whether a step's sample exceeds max_batch_size depends on whether one more row was sampled: the step
    neither raises nor truncates (which would also change the accounted mechanism), it processes the whole
    sample in several padded chunks. Same key: the same samples, the same noise, the same model as with room
    for every sample."""
    data = _data(4)
    key = jax.random.PRNGKey(4)
    small, roomy = _dp(N, steps=6, max_batch_size=2), _dp(N, steps=6, max_batch_size=N)
    sizes = [len(s) for s in _sampled(small, key, small.steps)]
    assert max(sizes) > 2 * small.max_batch_size  # several chunks at some step
    idx, mask = small.sample(jax.random.PRNGKey(0))
    assert idx.shape[0] % small.max_batch_size == 0 and mask.shape == idx.shape
    p_small, rep_small, h_small = small.fit(_params(), data, key, progress=False)
    p_roomy, _, h_roomy = roomy.fit(_params(), data, key, progress=False)
    assert len(h_small) == len(h_roomy) == 6 and rep_small.releases[0].count == 6
    for a, b in zip(jax.tree.leaves(p_small), jax.tree.leaves(p_roomy)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    for hs, hr in zip(h_small, h_roomy):
        assert hs["loss"] == pytest.approx(hr["loss"], rel=1e-5)
        assert hs["frac_clipped"] == pytest.approx(hr["frac_clipped"])


def _seqrec_case(with_user: bool):
    from jdp.seqrec import data as sdata
    rng = np.random.default_rng(0)
    n_items = 21  # item 21 is held by user 0 only
    seqs = [rng.integers(1, 21, rng.integers(4, 8)).astype(np.int32) for _ in range(40)]
    seqs[0] = np.array([3, 21, 5, 7, 2], np.int32)
    return sdata.leave_last_out(seqs if with_user else seqs[1:], n_items, 8)


@pytest.mark.slow
def test_seqrec_training_runs_every_step_with_a_nonfinite_user_and_counts_it(capsys):
    """User 0 alone reads item 21, whose input embedding is NaN (an untied output layer keeps every other user
    finite): that user's loss is non-finite at each step that samples it. Training completes the same steps as
    on the neighbour without user 0, counts the user in its private diagnostics, and prints none of them."""
    from jdp.seqrec import models, train

    cfg = train.TrainConfig(model="transformer-untied", epsilon=8.0, epochs=1.0, batch_size=20, d=8, blocks=1,
                            dropout=0.0, eval_chunk=64, length_buckets=(), n_users_public=40)
    runs = {}
    for with_user in (True, False):
        d = _seqrec_case(with_user)
        model = models.make_model(cfg.model, d.n_items, d.maxlen, cfg.d, cfg.heads, cfg.blocks, cfg.dropout,
                                  cfg.activation, cfg.norm, cfg.ffn_dim, cfg.item_dim)
        params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, d.maxlen), jnp.int32))
        table = params["params"]["item_embed"]["embedding"]
        params["params"]["item_embed"]["embedding"] = table.at[21].set(jnp.nan)
        runs[with_user] = train.train(d, cfg, jax.random.key(1), progress=True, evaluate_test=False,
                                      initial_params=params)
    bad, nb = runs[True], runs[False]
    assert bad.steps == nb.steps >= 2
    assert bad.timings["steps_done"] == nb.timings["steps_done"] == bad.steps and bad.timings["complete"]
    assert bad.private_diagnostics["num_nonfinite"] >= 1
    assert nb.private_diagnostics["num_nonfinite"] == 0
    assert sum(h["num_nonfinite"] for h in bad.history if "num_nonfinite" in h) == \
        bad.private_diagnostics["num_nonfinite"]
    printed = capsys.readouterr()
    assert "train_loss" not in printed.out + printed.err and "nonfinite" not in printed.out + printed.err
