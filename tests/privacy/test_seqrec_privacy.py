"""Seq-rec preprocessing privacy (audit item 7): the item vocabulary is public, private or named exact."""
import dataclasses
import math

import flax.serialization
import jax
import numpy as np
import pytest
from scipy import stats

from jdp import accounting
from jdp.seqrec import data, train

ROWS = [(1, 10, 5, 1), (1, 11, 4, 2), (1, 12, 3, 3), (2, 11, 5, 1), (2, 10, 4, 2), (2, 13, 1, 3),
        (3, 10, 2, 1), (3, 12, 3, 2), (3, 11, 4, 3)]


def _write(path, rows):
    path.write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in rows))
    return path


def test_public_vocabulary_unchanged_by_one_added_user(tmp_path):
    """Audit item 7: with a public catalogue, adding a user whose items appear nowhere else (one in the
    catalogue, one outside it) changes neither the vocabulary nor anyone else's item ids; the exact
    SASRec vocabulary does change, which is why it is named and stated as an assumption."""
    cat = np.array([10, 11, 12, 13, 14, 15])
    base = _write(tmp_path / "a.dat", ROWS)
    more = _write(tmp_path / "b.dat", ROWS + [(9, 15, 5, 1), (9, 99, 5, 2), (9, 14, 5, 3)])
    rep_a = accounting.PrivacyReport(1e-5)
    seqs_a, n_a = data.read_ratings(base, 1, 1, vocabulary="public", item_catalogue=cat, report=rep_a)
    seqs_b, n_b = data.read_ratings(more, 1, 1, vocabulary="public", item_catalogue=cat)
    assert n_a == n_b == 6
    for s, t in zip(seqs_a, seqs_b[:3]):
        np.testing.assert_array_equal(s, t)
    np.testing.assert_array_equal(seqs_b[3], [6, 5])  # catalogue order; item 99 (not in it) dropped
    assert not rep_a.releases and any("public catalogue of 6 items" in a for a in rep_a.assumptions)
    # exact counts: the added user's items enter the vocabulary (and it is said so in the report)
    rep_x = accounting.PrivacyReport(1e-5)
    n_x = data.read_ratings(base, 1, 1, report=rep_x)[1]
    assert n_x == 4 and data.read_ratings(more, 1, 1)[1] == 7
    assert rep_x.assumptions == [data.EXACT_VOCAB_ASSUMPTION]
    with pytest.raises(ValueError, match="item_catalogue"):
        data.read_ratings(base, 1, 1, vocabulary="public")
    with pytest.raises(ValueError, match="vocabulary"):
        data.read_ratings(base, 1, 1, vocabulary="exact")


def test_private_vocabulary_sensitivity_and_noise_scale():
    """Audit item 7: the private vocabulary is a Gaussian histogram of distinct items per user, each user
    capped at L items (L2 sensitivity sqrt(L), recorded in the report); one user moves the released
    counts by a 0/1 vector of at most L ones, and the noise std matches the recorded scale."""
    rng = np.random.default_rng(0)
    K, L, z = 3000, 4, 2.0
    cat = np.arange(100, 100 + K)
    seqs = [rng.choice(cat[:50], size=rng.integers(1, 12)) for _ in range(200)]
    heavy = np.repeat(cat[2000:2010], 3)  # 10 distinct items appearing nowhere else, each 3 times
    key = jax.random.key(3)
    rep = accounting.PrivacyReport(1e-5)
    kept, noisy = data.private_vocabulary(seqs, cat, 5.0, L, z, key, rep)
    kept2, noisy2 = data.private_vocabulary(seqs + [heavy], cat, 5.0, L, z, key, accounting.PrivacyReport(1e-5))
    diff = noisy2 - noisy  # same noise: the difference is the added user's own contribution
    np.testing.assert_allclose(diff, np.round(diff), atol=1e-9)
    assert set(np.round(diff)) <= {0.0, 1.0} and np.round(diff).sum() == L
    assert np.flatnonzero(np.round(diff)).min() >= 2000  # its L most recent distinct items
    (r,) = rep.releases
    assert r.sensitivity == pytest.approx(math.sqrt(L)) and r.noise_scale == pytest.approx(z * math.sqrt(L))
    assert r.event.noise_multiplier == pytest.approx(z)
    exact = np.zeros(K)
    for s in seqs:
        np.add.at(exact, np.unique(s) - 100, 1.0)  # these users have <= 11 distinct items: cap L=4 binds
    resid = noisy - exact
    untouched = exact == 0  # items nobody has: pure noise
    x = resid[untouched]
    chi2 = float((x ** 2).sum() / r.noise_scale ** 2)
    lo, hi = stats.chi2.ppf([1e-4, 1 - 1e-4], x.size)
    assert lo < chi2 < hi and abs(x.mean()) < 5 * r.noise_scale / math.sqrt(x.size)
    np.testing.assert_array_equal(kept, cat[noisy >= 5.0])


def test_private_vocabulary_release_in_training_report(tmp_path):
    """Audit item 7: load(..., vocabulary='private') carries its histogram release into the training report,
    whose σ is calibrated for the total; the exact default states its assumption; public Re-Attention
    counts are stated as declared public."""
    rng = np.random.default_rng(1)
    rows = []
    for u in range(1, 61):
        for t, i in enumerate(rng.choice(np.arange(1, 21), size=8, replace=False)):
            rows.append((u, int(i), 4, t))
    f = _write(tmp_path / "ratings.dat", rows)
    cat = np.arange(1, 31)
    d = data.load("ml-1m", path=f, maxlen=5, vocabulary="private", item_catalogue=cat, min_item_count=5,
                  vocab_noise_multiplier=3.0, key=jax.random.key(0))
    assert d.n_items <= 30 and len(d.vocab_releases) == 1
    assert d.vocab_releases[0].sensitivity == pytest.approx(math.sqrt(7))  # maxlen + 2 items per user
    cfg = train.TrainConfig(model="dpformer", item_init="random", epsilon=3.0, batch_size=16, epochs=2.0)
    rep, sigma, _, _ = train.privacy_setup(d, cfg, jax.random.key(1))
    names = [r.name for r in rep.releases]
    assert names[0].startswith("item vocabulary histogram") and len(names) == 3
    assert rep.epsilon() == pytest.approx(3.0, abs=1e-3)
    without = [r for r in rep.releases if not r.name.startswith("item vocabulary")]
    assert accounting.compute_epsilon(accounting.PrivacyReport(1e-5, releases=without).event(), 1e-5) < 2.99
    assert any("candidate items declared public" in a for a in rep.assumptions)
    d_exact = data.load("ml-1m", path=f, maxlen=5)
    rep_x, _, _, _ = train.privacy_setup(d_exact, cfg, jax.random.key(1), public_item_counts=np.ones(d_exact.n_items + 1))
    assert data.EXACT_VOCAB_ASSUMPTION in rep_x.assumptions
    assert any("item counts (public_item_counts) declared public" in a for a in rep_x.assumptions)
    assert data.EXACT_VOCAB_ASSUMPTION in rep_x.to_dict()["assumptions"]


def test_declared_user_count_fixes_the_sampling_plan():
    """Audit item 6 (seqrec): q = B/N and the number of steps come from a declared public number of users;
    without one the report states that the data's user count is treated as public."""
    import dataclasses as dc

    from jdp.seqrec.train import TrainConfig, privacy_setup, sampling_plan

    rng = np.random.default_rng(0)
    n_users, maxlen, n_items = 40, 6, 12
    seqs = rng.integers(1, n_items + 1, (n_users + 1, maxlen + 2)).astype(np.int32)

    def make(n):
        from jdp.seqrec.data import SeqData
        return SeqData(train_input=seqs[:n, :maxlen], train_target=seqs[:n, 1:maxlen + 1],
                       valid_input=seqs[:n, 1:maxlen + 1], valid_target=seqs[:n, maxlen + 1],
                       test_input=seqs[:n, 2:maxlen + 2], test_target=seqs[:n, maxlen + 1],
                       n_items=n_items, maxlen=maxlen)

    cfg = TrainConfig(model="transformer", epsilon=2.0, batch_size=8, epochs=2, n_users_public=100)
    assert sampling_plan(make(n_users), cfg) == sampling_plan(make(n_users + 1), cfg) == (100, 0.08, 25)
    with pytest.raises(ValueError, match="n_users_public"):
        sampling_plan(make(n_users), dc.replace(cfg, n_users_public=10))
    report, _, _, _ = privacy_setup(make(n_users), dc.replace(cfg, n_users_public=None), jax.random.key(0))
    assert any("number of users N = 40 treated as public" in a for a in report.assumptions)
    report, _, _, _ = privacy_setup(make(n_users), cfg, jax.random.key(0))
    assert not any("number of users" in a for a in report.assumptions)


def _worst_neighbour_step_change(model, loss_fn, C: float, seed: int, negatives=None) -> float:
    """‖Σ clipped grads with user 12 − without it‖ for one step's users laid out in length chunks, where user 12 is
    long enough to move every other user into other chunks (other windows, other chunk sizes); every user clipped."""
    import jax.numpy as jnp
    import optax

    from jdp import clipping as jc
    rng = np.random.default_rng(seed)
    n_items, L = model.n_items, 8
    seqs = [rng.integers(1, n_items + 1, rng.integers(3, 6)).astype(np.int32) for _ in range(12)]
    seqs.append(rng.integers(1, n_items + 1, 12).astype(np.int32))  # user 12: long, the added neighbour
    d = data.leave_last_out(seqs, n_items, L)
    params = jax.jit(model.init)(jax.random.key(0), jnp.asarray(d.train_input[:1]))
    dp = jc.dp_sgd(loss_fn, optax.sgd(0.1), num_examples=13, batch_size=4, l2_clip=C, delta=1e-5, steps=1,
                   noise_multiplier=1.0)
    windows = np.array([2, 4, 6, L])

    def step_sum(idx):
        acc = jax.tree.map(jnp.zeros_like, params)
        chunks = train.step_batches(d, np.asarray(idx), windows, 12, jax.random.key(1), negatives)
        for _, batch, mask in chunks:
            acc, _ = dp.accumulate(params, acc, batch, mask)
        return np.concatenate([np.ravel(x) for x in jax.tree.leaves(acc)]), [(w, int(m.size)) for w, _, m in chunks]

    base, layout = step_sum(np.arange(12))
    worst, layout2 = step_sum(np.arange(13))
    assert layout != layout2  # the added user changed the other users' chunks
    return float(np.linalg.norm(worst - base))


def test_sampled_softmax_step_moves_by_one_clipped_user_when_the_layout_changes():
    """Worst neighbour for the sampled softmax: an added user that reshuffles every other user into other
    chunks. The step's negatives are one draw shared by every chunk, so the accumulated clipped sum moves by
    exactly that user's clipped gradient (norm C)."""
    import jax.numpy as jnp

    from jdp.seqrec import models
    model = models.make_model("gru", 30, 8, d=8, dropout=0.0)
    negs = jnp.asarray(train.sample_negatives(jax.random.key(5), 30, 10, None))
    C = 1e-3  # every user is clipped: the bound is attained
    assert _worst_neighbour_step_change(model, models.make_loss_fn(model), C, 0, negs) == pytest.approx(C, rel=1e-3)


@pytest.mark.parametrize("norm", ["pre", pytest.param("post", marks=pytest.mark.slow)])
def test_dpformer_step_moves_by_one_clipped_user_in_either_block_layout(norm):
    """Worst neighbour for the full-softmax DPFormer (Re-Attention on, tied embedding, Phantom clipping), in both
    block layouts (SASRec's pre-LN, Vaswani's post-LN with a wider feed-forward): the same reshuffling neighbour,
    every user clipped; the accumulated clipped sum moves by exactly C. Dropout off: its masks are i.i.d. per user
    whatever the layout, so the analysis couples them; a fixed key would not."""
    import jax.numpy as jnp

    from jdp.seqrec import models
    model = models.make_model("dpformer", 30, 8, d=8, blocks=1, dropout=0.0, norm=norm,
                              ffn_dim=32 if norm == "post" else None)
    reatt = {"w_var": 1e-4, "emb_var": jnp.full((31,), 1e-2)}
    C = 1e-4  # every user is clipped: the bound is attained
    assert _worst_neighbour_step_change(model, models.make_loss_fn(model, reatt), C, 1) == pytest.approx(C, rel=1e-3)


@pytest.mark.parametrize("scale", [pytest.param(1.0, marks=pytest.mark.slow), 1e6])
def test_a_transition_prior_step_moves_by_one_clipped_user(scale):
    """The same worst neighbour for DPFormer with the release's transition prior in its logits (a Dense(1) site over
    every position and item), the prior's table at ordinary and at extreme scales (1e6: logits that saturate the
    softmax): the accumulated clipped sum moves by exactly C."""
    import jax.numpy as jnp

    from jdp.seqrec import models
    model = models.make_model("dpformer", 30, 8, d=8, blocks=1, dropout=0.0, prior=True)
    rng = np.random.default_rng(4)
    table = np.zeros((6, 31), np.float32)
    table[:5, rng.choice(np.arange(1, 31), 5, replace=False)] = rng.normal(0, scale, (5, 5))
    slot = np.full(31, 5, np.int32)
    slot[rng.choice(np.arange(1, 31), 5, replace=False)] = np.arange(5)
    reatt = {"w_var": 1e-4, "emb_var": jnp.full((31,), 1e-2), "prior_slot": jnp.asarray(slot),
             "prior_table": jnp.asarray(table)}
    C = 1e-4
    assert _worst_neighbour_step_change(model, models.make_loss_fn(model, reatt), C, 2) == pytest.approx(C, rel=1e-3)


@pytest.mark.slow
def test_baselines_never_read_exact_counts():
    """The popularity baseline is post-processing of released (or caller-declared public) counts only: a private
    model without such counts gets the zero-cost baseline alone, and the popularity ranking changes with the
    released histogram's noise (it is not the exact-count ranking)."""
    from jdp.seqrec.evaluate import baseline_metrics
    d = data.load("synthetic", data_seed=1, maxlen=8)
    cfg = dict(epsilon=8.0, epochs=0.2, batch_size=64, d=8, blocks=1, dropout=0.0, eval_chunk=512, length_buckets=())
    r = train.train(d, train.TrainConfig(model="gru", **cfg), jax.random.key(0), progress=False)
    assert set(r.baselines) == {"zero_cost"}
    r = train.train(d, train.TrainConfig(model="dpformer", **cfg), jax.random.key(0), progress=False)
    assert r.baselines["popularity"] == baseline_metrics(d, r.item_counts_released)["popularity"]
    exact = data.item_presence(d.train_input, d.train_target, d.n_items)
    assert not np.array_equal(r.item_counts_released, exact)
    # a vanilla model whose item table starts from a release ranks by that release's own popularity histogram
    start_cfg = train.TrainConfig(model="transformer", item_init="transitions", item_init_k=20, **cfg)
    r = train.train(d, start_cfg, jax.random.key(0), progress=False)
    start = train.privacy_setup(d, start_cfg, jax.random.split(jax.random.key(0), 3)[1]).item_start
    assert r.item_counts_released is None and not np.array_equal(start.counts, exact)
    assert r.baselines["popularity"] == baseline_metrics(d, start.counts)["popularity"]


def test_trainable_item_rows_come_from_released_counts_only():
    """`trainable_items`: the rows that train are the top-K of the RELEASED histogram (post-processing), which any
    model then releases inside the same budget; every other row stays exactly 0 (its noise is discarded)."""
    d = data.load("synthetic", data_seed=1, maxlen=8)
    cfg = train.TrainConfig(model="gru", epsilon=8.0, epochs=0.3, batch_size=64, d=8, blocks=1, dropout=0.0,
                            eval_chunk=512, length_buckets=(), lr=1e-2, trainable_items=10)
    r = train.train(d, cfg, jax.random.key(3), progress=False)
    assert [rel.name for rel in r.privacy.releases][0] == "item frequency histogram"
    assert r.privacy.epsilon() == pytest.approx(8.0, abs=1e-3)
    frozen = train.frozen_item_rows(r.item_counts_released, 10)
    assert (~frozen).sum() == 10 and frozen[0]
    emb = np.asarray(r.params["params"]["item_embed"]["embedding"])
    assert np.all(emb[frozen] == 0.0) and np.all(np.abs(emb[~frozen]).sum(axis=1) > 0)
    exact = data.item_presence(d.train_input, d.train_target, d.n_items)
    assert not np.array_equal(r.item_counts_released, exact)


def test_dpformer_blocks_are_tapped_and_their_per_user_norms_are_exact():
    """Re-Attention reads every block weight for its variance correction, under stop_gradient: that read has
    derivative 0, so the blocks are tapped (not the vmap fallback) and the per-user norms that set the clip factors
    must still be the exact ones (an underestimate would let a user move the sum by more than C)."""
    import jax.numpy as jnp

    from jdp import clipping as jc
    from jdp.seqrec import models
    model = models.make_model("dpformer", 40, 8, d=8, heads=2, blocks=1, dropout=0.5, activation="gelu")
    reatt = {"w_var": jnp.float32(3e-3), "emb_var": jnp.linspace(1e-3, 1.0, 41)}
    loss_fn = models.make_loss_fn(model, reatt)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    rng = np.random.default_rng(2)
    inputs = rng.integers(1, 41, (6, 5)).astype(np.int32)
    inputs[:2, :2] = 0  # left padding
    batch = {"input": jnp.asarray(inputs), "target": jnp.asarray(rng.integers(1, 41, (6, 5)).astype(np.int32)),
             "key": jax.random.split(jax.random.key(3), 6)}
    plan = jc.explain(loss_fn, params, batch)[-1]
    assert plan["fallback"] == [], plan["fallback"]
    def clipped(method):
        return jax.jit(lambda p, b: jc.clipped_grad(loss_fn, p, b, l2_clip=0.05, method=method))(params, batch)
    ref = clipped("vmap")
    for method in ("auto", "ghost"):
        got = clipped(method)
        np.testing.assert_allclose(np.asarray(got.norms), np.asarray(ref.norms), rtol=1e-4)
        diff = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(jax.tree.leaves(got.grad_sum), jax.tree.leaves(ref.grad_sum)))
        assert math.sqrt(diff) <= 1e-4 * 0.05 * 6


def test_item_table_start_is_accounted_at_its_share_and_composed_into_epsilon():
    """item_init="transitions": the popularity and transition releases the item table starts from are in the
    run's report at sensitivity 1 (each user's vectors have norm 1: tests/privacy/test_seqrec_transitions_privacy),
    alone they spend their share of ε (PRIOR_EPSILON_SHARE with the default transition prior, else
    ITEM_INIT_EPSILON_SHARE), and with the DP-SGD steps exactly ε."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 31, rng.integers(2, 12)).astype(np.int32) for _ in range(300)]
    d = data.leave_last_out(seqs, 30, 8)
    cfg = train.TrainConfig(model="dpformer", epsilon=6.0, batch_size=32, epochs=3.0, item_init="transitions",
                            item_init_k=10)
    rep, sigma, _, start = train.privacy_setup(d, cfg, jax.random.key(0))
    item = [r for r in rep.releases if r.name.startswith(("item popularity", "item transition"))]
    assert [r.sensitivity for r in item] == [1.0, 1.0] and item[1].noise_scale == start.noise_multiplier
    alone = accounting.PrivacyReport(cfg.delta, releases=item)
    assert alone.epsilon() == pytest.approx(train.PRIOR_EPSILON_SHARE * 6.0, rel=1e-3)
    assert rep.epsilon() == pytest.approx(6.0, rel=1e-3)
    no_prior = dataclasses.replace(cfg, transition_prior=False)
    rep_half, sigma_half, _, _ = train.privacy_setup(d, no_prior, jax.random.key(0))
    item = [r for r in rep_half.releases if r.name.startswith(("item popularity", "item transition"))]
    assert accounting.PrivacyReport(cfg.delta, releases=item).epsilon() == pytest.approx(
        train.ITEM_INIT_EPSILON_SHARE * 6.0, rel=1e-3)
    assert rep_half.epsilon() == pytest.approx(6.0, rel=1e-3) and sigma_half < sigma
    random_start = dataclasses.replace(cfg, item_init="random", item_init_k=None)
    assert train.privacy_setup(d, random_start, jax.random.key(0))[1] < sigma


def test_training_goes_on_past_steps_with_nonfinite_users_and_counts_them():
    """The engine drops a non-finite user (the bound holds) and training goes on: stopping or raising at that step
    would release, outside the report, that such a user was sampled (a private loop never branches on the data).
    The users dropped are a private diagnostic beside the result. Worst input: one item's input row is NaN, read
    only by the users whose sequences hold it (an untied output layer keeps every other user finite)."""
    import jax.numpy as jnp

    from jdp.seqrec import models
    d = data.load("synthetic", data_seed=1, maxlen=8)
    cfg = train.TrainConfig(model="transformer-untied", epsilon=8.0, epochs=0.2, batch_size=64, d=8, blocks=1,
                            dropout=0.0, eval_chunk=512, length_buckets=())
    model = models.make_model(cfg.model, d.n_items, d.maxlen, cfg.d, cfg.heads, cfg.blocks, cfg.dropout,
                              cfg.activation, cfg.norm, cfg.ffn_dim, cfg.item_dim)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, d.maxlen), jnp.int32))
    item = int(np.bincount(d.train_input.ravel(), minlength=d.n_items + 1)[1:].argmax()) + 1  # read by many
    table = params["params"]["item_embed"]["embedding"]
    params["params"]["item_embed"]["embedding"] = table.at[item].set(jnp.nan)
    res = train.train(d, cfg, jax.random.key(0), progress=False, initial_params=params)
    assert res.timings["complete"] and res.timings["steps_done"] == res.steps
    assert res.private_diagnostics["num_nonfinite"] >= 1
    assert sum(h.get("num_nonfinite", 0) for h in res.history) == res.private_diagnostics["num_nonfinite"]


@pytest.mark.slow
def test_a_checkpoint_resumes_only_the_run_that_wrote_it(tmp_path):
    """Resuming is continuing ONE run. Worst resumptions: a larger budget after steps taken at a smaller σ (the
    report would state the new ε for steps that spent more), another seed (the histogram and every later step
    drawn again: releases the report does not count), other data under the same seed (one noise draw on two
    datasets), another declared public histogram, and a checkpoint without its run record. Each is refused before
    any work; the same run, with only evaluation and speed settings changed, resumes."""
    d = data.load("synthetic", data_seed=1, maxlen=8)
    cfg = train.TrainConfig(model="dpformer", epsilon=2.0, epochs=0.2, batch_size=64, d=8, blocks=1, dropout=0.0,
                            eval_chunk=512, length_buckets=())
    ck = tmp_path / "run.ckpt"
    first = train.train(d, cfg, jax.random.key(0), checkpoint=ck, progress=False, evaluate_test=False, max_steps=1)
    assert first.timings["steps_done"] == 1 and (tmp_path / "run.ckpt.run.json").exists()
    # the file holds no noise key: with it, anyone holding the file and a later model could subtract the later
    # steps' noise (the key is rebuilt from the run's key on resume; `test_train` checks the resumed run is the same)
    saved = flax.serialization.msgpack_restore(ck.read_bytes())["opt_state"]["0"]
    assert int(saved["count"]) == 1 and not np.any(np.asarray(saved["key"]))
    other = dataclasses.replace(d, train_target=np.where(d.train_target == 1, 2, d.train_target))
    for args, what in [((d, dataclasses.replace(cfg, epsilon=8.0), jax.random.key(0)), "config.epsilon"),
                       ((d, cfg, jax.random.key(1)), "key"),
                       ((other, cfg, jax.random.key(0)), "train_data")]:
        with pytest.raises(ValueError, match=f"another run \\(different {what}\\)"):
            train.train(*args, checkpoint=ck, progress=False, evaluate_test=False)
    with pytest.raises(ValueError, match="different public_item_counts"):
        train.train(d, cfg, jax.random.key(0), public_item_counts=np.ones(d.n_items + 1), checkpoint=ck,
                    progress=False, evaluate_test=False)
    resumed = train.train(d, dataclasses.replace(cfg, eval_chunk=256, batch_chunk=None), jax.random.key(0),
                          checkpoint=ck, progress=False, evaluate_test=False)
    assert resumed.timings["complete"] and resumed.timings["steps_done"] == resumed.steps > 1
    (tmp_path / "run.ckpt.run.json").unlink()
    with pytest.raises(ValueError, match="no run record"):
        train.train(d, cfg, jax.random.key(0), checkpoint=ck, progress=False, evaluate_test=False)
