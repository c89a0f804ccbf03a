"""DP training loop: the library's clipping on DPFormer, length chunks, privacy report (histogram release),
checkpoints and resume, errors."""
import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jdp import clipping as jc

from jdp import accounting
from jdp.seqrec import data, models, nonprivate, train, transitions
from jdp.clipping import clipped_grad

logging.getLogger("absl").setLevel(logging.ERROR)


def _toy(n_users=48, n_items=20, maxlen=6, seed=0):
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(n_users):  # cyclic walks: the next item is predictable
        start, n = rng.integers(1, n_items + 1), rng.integers(2, 10)
        seqs.append(((start - 1 + np.arange(n)) % n_items + 1).astype(np.int32))
    return data.leave_last_out(seqs, n_items, maxlen)


def _assert_equals_naive_clipping(loss_fn, params, batch, method, clip=0.05):
    B = batch["input"].shape[0]
    mask = jnp.array([1, 1, 1, 0] + [1] * (B - 4), jnp.float32)
    res = jax.jit(lambda p: clipped_grad(loss_fn, p, batch, l2_clip=clip, mask=mask, method=method))(params)
    one = jax.jit(jax.grad(lambda p, ex: loss_fn(p, ex)[0]))
    want = jax.tree_util.tree_map(jnp.zeros_like, params)
    for i in range(B):
        g = one(params, jax.tree_util.tree_map(lambda a: a[i:i + 1], batch))
        n = float(jnp.sqrt(sum(jnp.sum(x ** 2) for x in jax.tree_util.tree_leaves(g))))
        if mask[i]:
            assert float(res.norms[i]) == pytest.approx(n, rel=1e-4)
            want = jax.tree_util.tree_map(lambda a, b: a + b * min(1.0, clip / n), want, g)
    assert float(res.norms[3]) == 0.0
    for a, b in zip(jax.tree_util.tree_leaves(res.grad_sum), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("method,norm", [("auto", "pre"), ("auto", "post"),
                                         pytest.param("vmap", "pre", marks=pytest.mark.slow)])
def test_library_clipping_on_dpformer_equals_naive_per_example_clipping(method, norm):
    d = _toy()
    model = models.make_model("dpformer", d.n_items, d.maxlen, d=8, heads=1, blocks=1, dropout=0.0, norm=norm,
                              ffn_dim=None if norm == "pre" else 16)
    params = jax.jit(model.init)(jax.random.key(0), jnp.asarray(d.train_input[:2]))
    reatt = {"w_var": 1e-4, "emb_var": jnp.full((d.n_items + 1,), 1e-2)}
    B = 8
    batch = {"input": jnp.asarray(d.train_input[:B]), "target": jnp.asarray(d.train_target[:B]),
             "key": jax.random.split(jax.random.key(1), B)}
    _assert_equals_naive_clipping(models.make_loss_fn(model, reatt, deterministic=True), params, batch, method)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["auto", "ghost"])
def test_a_frozen_item_table_is_clipped_like_naive_per_example_clipping_and_gets_no_gradient(method):
    # freeze_item_table: the tied table is read under stop_gradient by the input lookup and the output layer
    d = _toy()
    model = models.make_model("dpformer", d.n_items, d.maxlen, d=8, heads=1, blocks=1, dropout=0.0)
    params = jax.jit(model.init)(jax.random.key(0), jnp.asarray(d.train_input[:2]))
    reatt = {"w_var": 1e-4, "emb_var": jnp.full((d.n_items + 1,), 1e-2)}
    batch = {"input": jnp.asarray(d.train_input[:8]), "target": jnp.asarray(d.train_target[:8]),
             "key": jax.random.split(jax.random.key(1), 8)}
    loss_fn = train.freeze_item_table_loss(models.make_loss_fn(model, reatt, deterministic=True))
    _assert_equals_naive_clipping(loss_fn, params, batch, method)
    res = clipped_grad(loss_fn, params, batch, l2_clip=0.05, method=method)
    assert not np.asarray(res.grad_sum["params"]["item_embed"]["embedding"]).any()
    assert jc.explain(loss_fn, params, batch)[-1]["fallback"] == []  # everything else is tapped


@pytest.mark.slow
def test_library_clipping_on_a_factorised_item_table_equals_naive_per_example_clipping():
    # item_dim < d: a [M+1, r] table read by the input lookup and the tied output, with r→d and d→r projections
    d = _toy()
    model = models.make_model("transformer", d.n_items, d.maxlen, d=8, heads=1, blocks=1, dropout=0.0, item_dim=3)
    params = jax.jit(model.init)(jax.random.key(0), jnp.asarray(d.train_input[:2]))
    assert params["params"]["item_embed"]["embedding"].shape == (d.n_items + 1, 3)
    assert params["params"]["item_in"]["kernel"].shape == (3, 8) and params["params"]["item_out"]["kernel"].shape == (8, 3)
    B = 8
    batch = {"input": jnp.asarray(d.train_input[:B]), "target": jnp.asarray(d.train_target[:B]),
             "key": jax.random.split(jax.random.key(1), B)}
    _assert_equals_naive_clipping(models.make_loss_fn(model, None, deterministic=True), params, batch, "auto")


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["dpformer", "gru"])
def test_sampled_softmax_clipping_equals_naive_per_example_clipping(model_name):
    # the tied table is read three times (inputs, targets, the step's shared negatives): the engine's
    # lookup norms (sort-based for long lookups) must still give every user's exact gradient norm
    d = _toy()
    model = models.make_model(model_name, d.n_items, d.maxlen, d=8, heads=1, blocks=1, dropout=0.0)
    params = jax.jit(model.init)(jax.random.key(0), jnp.asarray(d.train_input[:2]))
    probs = np.linspace(1.0, 3.0, d.n_items)
    probs /= probs.sum()
    negs = train.sample_negatives(jax.random.key(3), d.n_items, 12, probs)
    assert len(set(negs.tolist())) == 12 and negs.min() >= 1 and negs.max() <= d.n_items
    log_q = jnp.log(jnp.asarray(np.concatenate([[1.0], probs]), jnp.float32))
    B = 8
    batch = {"input": jnp.asarray(d.train_input[:B]), "target": jnp.asarray(d.train_target[:B]),
             "key": jax.random.split(jax.random.key(1), B), "negatives": jnp.broadcast_to(jnp.asarray(negs), (B, 12))}
    _assert_equals_naive_clipping(models.make_loss_fn(model, None, deterministic=True, log_q=log_q), params, batch,
                                  "auto")


def test_sampled_loss_is_corrected_cross_entropy_without_accidental_hits():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)  # [target, 3 negatives]
    targets = jnp.array([[0, 5, 2], [1, 2, 3]])
    negs = jnp.array([[2, 4, 6], [3, 7, 9]])
    log_q = jnp.log(jnp.arange(1.0, 11.0) / 55.0)
    got = np.asarray(models.sampled_next_item_loss(logits, targets, negs, log_q))
    want = []
    for b in range(2):
        tot, n = 0.0, 0
        for t in range(3):
            if targets[b, t] == 0:
                continue
            ids = [int(targets[b, t])] + [int(x) for x in negs[b]]
            z = np.asarray(logits[b, t]) - np.asarray(log_q)[ids]
            keep = [0] + [j + 1 for j, x in enumerate(negs[b]) if int(x) != int(targets[b, t])]
            z = z[keep]
            tot += np.log(np.exp(z).sum()) - z[0]
            n += 1
        want.append(tot / n)
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.slow
def test_private_dpformer_report_histogram_checkpoint(tmp_path):
    d = _toy()
    cfg = train.TrainConfig(model="dpformer", item_init="random", epsilon=4.0, epochs=1.0, batch_size=16, chunk_rows=256,
                            d=8, blocks=1, dropout=0.1, lr=1e-2, eval_chunk=32, length_buckets=())
    ck = tmp_path / "ck.msgpack"
    r = train.train(d, cfg, jax.random.key(0), checkpoint=ck, progress=False)
    names = [rel.name for rel in r.privacy.releases]
    assert names[0] == "item frequency histogram" and "DP-SGD" in names[1]
    hist = r.privacy.releases[0]
    assert hist.sensitivity == pytest.approx(np.sqrt(d.maxlen + 1))
    assert r.privacy.releases[1].count == r.steps == 3
    assert r.privacy.epsilon() == pytest.approx(4.0, abs=1e-3)
    # the released counts are noisy (never the exact counts)
    exact = data.item_presence(d.train_input, d.train_target, d.n_items)
    assert np.abs(r.item_counts_released - exact).max() > 1.0
    for k in ("ndcg_at_10_test", "hit_at_10_test", "ndcg_at_10_valid", "hit_at_10_valid"):
        assert 0.0 <= r.metrics[k] <= 1.0
    assert r.metrics["ndcg_at_10_test"] <= r.metrics["hit_at_10_test"]
    # the other evaluation protocol beside it: removing history items can only lift the target's rank
    assert r.metrics["ndcg_at_10_test_history_masked"] >= r.metrics["ndcg_at_10_test"]
    assert r.metrics["hit_at_10_test_history_masked"] >= r.metrics["hit_at_10_test"]
    d_json = r.privacy.to_dict()
    assert d_json["releases"][0]["name"] == "item frequency histogram"
    # baselines beside the model: zero cost (own history) and popularity from the RELEASED counts
    from jdp.seqrec.evaluate import baseline_metrics
    assert r.baselines == baseline_metrics(d, r.item_counts_released)
    assert set(r.baselines) == {"zero_cost", "popularity"}
    # resume from the final checkpoint: no steps left, same parameters
    r2 = train.train(d, cfg, jax.random.key(0), checkpoint=ck, progress=False, evaluate_test=False)
    assert r2.timings["steps_run"] == 0
    assert not any("test" in k for m in r2.baselines.values() for k in m)  # evaluate_test=False: test untouched
    for a, b in zip(jax.tree_util.tree_leaves(r.params), jax.tree_util.tree_leaves(r2.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # stopped after one step, then resumed: the same run as the uninterrupted one
    ck1 = tmp_path / "ck1.msgpack"
    r1 = train.train(d, cfg, jax.random.key(0), checkpoint=ck1, progress=False, evaluate_test=False, max_steps=1)
    assert r1.timings["steps_done"] == 1 and not r1.timings["complete"]
    r3 = train.train(d, cfg, jax.random.key(0), checkpoint=ck1, progress=False, evaluate_test=False)
    assert r3.timings["steps_run"] == 2 and r3.timings["complete"]
    for a, b in zip(jax.tree_util.tree_leaves(r.params), jax.tree_util.tree_leaves(r3.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # caller-declared public counts: no histogram release, the whole budget goes to DP-SGD
    pub = np.arange(d.n_items + 1, dtype=float)
    rep3, sigma3, counts3, _ = train.privacy_setup(d, cfg, jax.random.key(0), public_item_counts=pub)
    assert [rel.name for rel in rep3.releases] == names[1:]
    assert sigma3 < r.noise_multiplier
    np.testing.assert_array_equal(counts3, pub)
    assert train.privacy_setup(d, dataclasses.replace(cfg, epsilon=None), jax.random.key(0)) == (None, 0.0, None, None)


def test_length_chunks_cover_every_user_once_in_a_window_that_fits():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 51, 300)
    windows = np.array([1, 2, 4, 8, 16, 32, 50])
    chunks = train.length_chunks(lengths, windows, rows=64)
    seen = np.concatenate([pos[:n] for _, pos, n in chunks])
    np.testing.assert_array_equal(np.sort(seen), np.arange(300))  # each user exactly once
    for w, pos, n in chunks:
        assert lengths[pos[:n]].max() <= w and (w == 1 or lengths[pos[:n]].max() > windows[windows < w].max())
        assert pos.size == max(1, 64 // w) or (pos.size & (pos.size - 1) == 0 and (w, pos, n) is chunks[-1])
    assert sum(n for _, _, n in chunks[:-1]) + chunks[-1][2] == 300
    # a step that fits in one chunk is padded to the full chunk: the same compiled shape for every step
    for n_users in (37, 50, 64):
        (w, pos, n), = train.length_chunks(lengths[:n_users], np.array([50]), rows=64 * 50)
        assert (w, pos.size, n) == (50, 64, n_users)


@pytest.mark.slow  # CI runs it (make test-slow)
def test_chunked_dp_sgd_sum_equals_one_full_window_batch():
    """The length layout only saves compute: the clipped sums of a sample laid out in short windows equal
    those of the same users in full-length windows (masked padding rows, right-anchored positions)."""
    d = _toy(n_users=24)
    model = models.make_model("dpformer", d.n_items, d.maxlen, d=8, heads=1, blocks=1, dropout=0.0)
    params = jax.jit(model.init)(jax.random.key(0), jnp.asarray(d.train_input[:2]))
    reatt = {"w_var": 1e-4, "emb_var": jnp.full((d.n_items + 1,), 1e-2)}
    loss_fn = models.make_loss_fn(model, reatt)
    dp = jc.dp_sgd(loss_fn, optax.sgd(0.1), num_examples=24, batch_size=8, l2_clip=0.05, delta=1e-5, steps=1,
                   noise_multiplier=1.0)
    users = np.arange(24)
    keys = jax.random.split(jax.random.key(3), 24)
    zero = jax.tree_util.tree_map(jnp.zeros_like, params)
    full = {"input": jnp.asarray(d.train_input), "target": jnp.asarray(d.train_target), "key": keys}
    want, _ = dp.accumulate(params, zero, full, jnp.ones(24, bool))
    acc, L = zero, d.maxlen
    lens = (d.train_input > 0).sum(1)
    for w, pos, n in train.length_chunks(lens, np.array([2, 4, L]), rows=16):
        u = users[pos]
        batch = {"input": jnp.asarray(d.train_input[u, L - w:]), "target": jnp.asarray(d.train_target[u, L - w:]),
                 "key": keys[u]}
        acc, _ = dp.accumulate(params, acc, batch, jnp.asarray(np.arange(pos.size) < n))
    for a, b in zip(jax.tree_util.tree_leaves(acc), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize("batch_chunk", [pytest.param(c, marks=pytest.mark.slow) for c in (None, 3)] + ["auto"])
def test_nonprivate_step_sums_the_same_gradients_in_any_pass_size(batch_chunk):
    """The NON-PRIVATE reference step's gradient sum over a physical chunk (masked padding rows) is the sum
    of the real users' gradients, whether the chunk runs in one pass or as a loop over smaller ones."""
    d = _toy(n_users=10)
    model = models.make_model("transformer", d.n_items, d.maxlen, d=8, heads=1, blocks=1, dropout=0.0)
    params = jax.jit(model.init)(jax.random.key(0), jnp.asarray(d.train_input[:2]))
    loss_fn = models.make_loss_fn(model)
    _, accumulate, _ = nonprivate.nonprivate_step(loss_fn, optax.sgd(0.1), params, 8.0, batch_chunk)
    batch = {"input": jnp.asarray(d.train_input), "target": jnp.asarray(d.train_target),
             "key": jax.random.split(jax.random.key(3), 10)}
    mask = jnp.asarray(np.arange(10) < 7)
    zero = jax.tree_util.tree_map(jnp.zeros_like, params)
    got, sums = accumulate(params, zero, batch, mask)
    one = jax.jit(jax.grad(lambda p, ex: loss_fn(p, ex)[0]))
    want = zero
    for i in range(7):
        want = jax.tree_util.tree_map(jnp.add, want, one(params, jax.tree_util.tree_map(lambda a: a[i:i + 1], batch)))
    assert int(sums["count"]) == 7
    assert float(sums["loss_sum"]) == pytest.approx(float(jnp.sum(loss_fn(params, batch)[:7])), rel=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_invalid_configs_raise():
    d = _toy()
    with pytest.raises(ValueError, match="epsilon"):
        train.train(d, train.TrainConfig(epsilon=0.0), jax.random.key(0))
    with pytest.raises(ValueError, match="delta"):
        train.train(d, train.TrainConfig(delta=1.5), jax.random.key(0))
    with pytest.raises(ValueError, match="batch_size"):
        train.train(d, train.TrainConfig(batch_size=10_000), jax.random.key(0))
    with pytest.raises(ValueError, match="model"):
        models.make_model("bert", 10, 5)
    with pytest.raises(ValueError, match="norm"):
        models.make_model("transformer", 10, 5, norm="sandwich")
    with pytest.raises(ValueError, match="ffn_dim"):
        train.TrainConfig(ffn_dim=0).validate()
    for model, item_dim in (("dpformer", 16), ("gru", 16), ("transformer", 0), ("transformer", 65)):
        with pytest.raises(ValueError, match="item_dim"):
            train.TrainConfig(model=model, item_dim=item_dim).validate()
    with pytest.raises(ValueError, match="public_item_counts"):
        train.train(d, train.TrainConfig(batch_size=8, epochs=0.1), jax.random.key(0), public_item_counts=np.ones(3))
    for bad in ({"item_init": "svd"}, {"item_init": "transitions", "model": "gru"},
                {"item_init": "transitions", "model": "transformer", "item_dim": 16},
                {"item_init": "transitions", "model": "transformer", "norm": "post"},
                {"item_init": "transitions", "item_init_k": 0}, {"item_init": "transitions", "item_init_noise": 0.0}):
        with pytest.raises(ValueError, match="item_init"):
            train.TrainConfig(**bad).validate()
    for unused in ({"item_init_k": 5}, {"item_init_noise": 1.0}):  # used as given or refused
        for cfg in ({"item_init": "random"}, {"model": "gru"}, {"epsilon": None}):
            with pytest.raises(ValueError, match="release start"):
                train.TrainConfig(**cfg, **unused).validate()
    train.TrainConfig(item_init="auto", item_init_k=5, item_init_noise=1.0).validate()
    for bad in ({"item_init": "random"}, {"model": "gru"}, {"epsilon": None}, {"negatives": 5}):  # no release to score
        with pytest.raises(ValueError, match="transition_prior"):
            train.TrainConfig(transition_prior=True, **bad).validate()
    with pytest.raises(ValueError, match="prior"):
        models.make_model("gru", 10, 5, prior=True)


def test_inputs_that_cannot_be_used_are_refused_before_any_release(monkeypatch):
    from jdp.seqrec import prepare as prep

    def no_release(*a, **k):
        raise AssertionError("a release was made before the input was checked")
    monkeypatch.setattr(prep, "privacy_setup", no_release)
    monkeypatch.setattr(prep, "_lower_first_step", no_release)
    d = _toy()
    with pytest.raises(ValueError, match="item_init_k"):
        train.train(d, train.TrainConfig(batch_size=8, epochs=0.1, item_init="transitions", item_init_k=21),
                    jax.random.key(0))
    with pytest.raises(ValueError, match="initial_params"):
        train.train(d, train.TrainConfig(batch_size=8, epochs=0.1), jax.random.key(0), initial_params={"params": {}})
    params = jax.eval_shape(models.make_model("dpformer", d.n_items, d.maxlen, prior=True).init,  # the default's
                            jax.random.key(0), jnp.zeros((1, d.maxlen), jnp.int32))
    bad = jax.tree.map(lambda x: np.zeros(x.shape[:-1] + (x.shape[-1] + 1,), np.float32), params)
    with pytest.raises(ValueError, match="wrong shape"):
        train.train(d, train.TrainConfig(batch_size=8, epochs=0.1), jax.random.key(0), initial_params=bad)
    # sanity: the calibrated noise multiplier matches the accountant for the composed events
    ev = train.dp_sgd_event(1.0, 0.1, 100)
    assert accounting.compute_epsilon(ev, 1e-5) > 0


@pytest.mark.slow
def test_sampled_softmax_training_states_its_negatives_and_learns():
    d = _toy(n_users=96)
    base = train.TrainConfig(model="gru", epsilon=None, epochs=6.0, batch_size=32, chunk_rows=1024, d=16,
                             dropout=0.0, lr=3e-2, warmup_frac=0.0, eval_chunk=64, length_buckets=(), negatives=8)
    r = train.train(d, base, jax.random.key(0), progress=False, evaluate_test=False)
    assert r.privacy is None and r.metrics["hit_at_10_valid"] > 0.8  # cyclic walks: learnable from 8 negatives
    # private: the report says where the negatives come from; popularity needs public or released counts
    cfg = dataclasses.replace(base, model="dpformer", epsilon=4.0, negative_sampler="popularity")
    report = accounting.PrivacyReport(1e-5)
    released = np.concatenate([[0.0], np.linspace(-2.0, 30.0, d.n_items)])  # noisy counts can be negative
    probs = train.negative_probs(d, cfg, released, False, report)
    assert probs.shape == (d.n_items,) and probs.min() > 0 and probs.sum() == pytest.approx(1.0)
    assert probs[-1] > 10 * probs[0]
    assert any("released item histogram" in a and "8 distinct negatives" in a for a in report.assumptions)
    assert train.negative_probs(d, dataclasses.replace(cfg, negative_sampler="uniform"), None, False, None) is None
    with pytest.raises(ValueError, match="public_item_counts"):
        train.train(d, dataclasses.replace(cfg, model="gru"), jax.random.key(0), progress=False)
    with pytest.raises(ValueError, match="negatives must be <"):
        train.train(d, dataclasses.replace(base, negatives=d.n_items), jax.random.key(0), progress=False)
    with pytest.raises(ValueError, match="tied"):
        dataclasses.replace(base, model="transformer-untied").validate()


def test_baseline_ranks_equal_brute_force_rankings():
    from jdp.seqrec.evaluate import baseline_metrics, own_history_ranks, popularity_ranks
    rng = np.random.default_rng(0)
    M, U, L = 12, 200, 6
    inputs = rng.integers(0, M + 1, (U, L))
    targets = rng.integers(1, M + 1, U)
    scores = rng.integers(0, 5, M + 1).astype(float)   # ties on purpose
    for u in range(U):
        # zero cost: distinct history items by recency (most recent = highest score), the rest tied at 0
        s = np.zeros(M + 1)
        seen = []
        for item in inputs[u][::-1]:
            if item > 0 and item not in seen:
                seen.append(item)
        for pos, item in enumerate(seen):
            s[item] = L + 1 - pos
        brute = np.sum(s[1:] >= s[targets[u]]) - 1               # pessimistic ties, padding never ranked
        assert own_history_ranks(inputs[u:u + 1], targets[u:u + 1], M)[0] == brute
        assert popularity_ranks(targets[u:u + 1], scores)[0] == np.sum(scores[1:] >= scores[targets[u]]) - 1
    toy = _toy()
    got = baseline_metrics(toy)
    assert set(got) == {"zero_cost"} and 0.0 <= got["zero_cost"]["ndcg_at_10_test"] <= got["zero_cost"]["hit_at_10_test"] <= 1


def test_frozen_item_rows_keep_the_top_counts_and_never_move():
    counts = np.array([99.0, 5.0, 7.0, 7.0, 1.0, 6.0])  # index 0 = padding (always frozen)
    np.testing.assert_array_equal(train.frozen_item_rows(counts, 3), [True, True, False, False, True, False])
    assert not train.frozen_item_rows(counts, 99)[1:].any()  # more than the catalogue: every item trains
    with pytest.raises(ValueError):
        train.frozen_item_rows(counts, 0)
    with pytest.raises(ValueError):
        train.TrainConfig(trainable_items=-1).validate()
    # the optimiser leaves frozen rows where they are; the others move
    frozen = train.frozen_item_rows(counts, 2)
    params = {"params": {"item_embed": {"embedding": jnp.ones((6, 3))}, "dense": {"kernel": jnp.ones((3, 3))}}}
    params = train.zero_item_rows(params, frozen)
    tx = optax.chain(optax.adamw(0.1, weight_decay=0.1), train.freeze_item_rows(frozen))
    state = tx.init(params)
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    upd, _ = tx.update(grads, state, params)
    new = optax.apply_updates(params, upd)
    emb = np.asarray(new["params"]["item_embed"]["embedding"])
    assert np.all(emb[frozen] == 0.0) and np.all(emb[~frozen] != 1.0)
    assert np.all(np.asarray(new["params"]["dense"]["kernel"]) != 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("prior", [True, False])
def test_first_step_compiles_while_sigma_is_calibrated_and_only_once(caplog, monkeypatch, prior):
    # the first step's clipped accumulation is compiled on abstract parameters beside the calibration; the run
    # then calls the very same jitted function (it does not read σ), so no chunk shape compiles twice; with the
    # transition prior too (its table's rows, K + 1, are public before the release)
    from jdp.seqrec import prepare as prep
    lowered = []
    lower = prep._lower_first_step
    monkeypatch.setattr(prep, "_lower_first_step", lambda *a: lowered.append(a[-1]) or lower(*a))
    d = _toy()
    cfg = train.TrainConfig(model="dpformer", epsilon=4.0, epochs=1.0, batch_size=16, chunk_rows=256,
                            d=8, blocks=1, dropout=0.1, lr=1e-2, eval_chunk=32, length_buckets=(),
                            transition_prior=prior)
    jax.config.update("jax_log_compiles", True)  # process-wide: the context manager is thread-local
    try:
        with caplog.at_level(logging.WARNING):
            r = train.train(d, cfg, jax.random.key(3), progress=False, evaluate_test=False)
    finally:
        jax.config.update("jax_log_compiles", False)
    compiled = [m for m in caplog.messages if m.startswith("Compiling jit(accumulate)")]
    assert len(compiled) == sum(r.timings["step_new_shapes"]) >= 1  # one compilation per chunk shape
    assert sum(m.startswith("Compiling jit(_apply)") for m in caplog.messages) == 1  # precompiled on shapes
    assert r.timings["complete"]
    assert len(lowered) == 1 and (lowered[0] > 1) == prior  # the prior's table rows, K + 1 (0: no prior)
    # one function for every σ: DPSGD.accumulate is clipped_accumulate of its clipping settings
    loss = models.make_loss_fn(models.make_model("transformer", d.n_items, d.maxlen, 8, 1, 1, 0.0))
    kw = dict(num_examples=48, batch_size=16, l2_clip=1.0, delta=1e-5, steps=3)
    a = jc.dp_sgd(loss, optax.adam(1e-3), noise_multiplier=0.7, **kw)
    b = jc.dp_sgd(loss, optax.adam(1e-3), noise_multiplier=1.9, **kw)
    assert a.accumulate is b.accumulate is jc.clipped_accumulate(loss, 1.0)
    assert a.apply is not b.apply  # the noisy update does read σ


@pytest.mark.slow
def test_item_table_starts_from_the_transition_release_and_the_model_starts_as_its_scorer():
    d = _toy(n_users=64)
    cfg = train.TrainConfig(model="transformer", epsilon=4.0, batch_size=16, epochs=0.5, d=8, blocks=2, dropout=0.0,
                            item_init="transitions", item_init_k=6, length_buckets=())
    setup = train.privacy_setup(d, cfg, jax.random.key(2))
    start = setup.item_start
    assert start.items.size == 6 and start.noise_multiplier > 1.0  # calibrated: the item releases alone spend ε/2
    with pytest.raises(ValueError, match="already spend"):
        train.privacy_setup(d, dataclasses.replace(cfg, item_init_noise=1.0), jax.random.key(2))
    model = models.make_model("transformer", d.n_items, d.maxlen, 8, 1, 2, 0.0)
    params = model.init(jax.random.key(0), jnp.zeros((1, d.maxlen), jnp.int32))
    began = train.start_from_item_table(params, start)
    table = np.asarray(began["params"]["item_embed"]["embedding"])
    emb = transitions.item_embedding(start, 7)
    np.testing.assert_allclose(table[start.items, :7], emb.rows, rtol=1e-6)
    prior = table[start.items, 7] * np.sqrt(8)                    # log(c_j / c_min) ≥ 0, larger for more popular items
    counts = start.counts[start.items]
    assert prior.min() == pytest.approx(0.0, abs=1e-6) and np.all(np.diff(prior[np.argsort(counts)]) >= -1e-6)
    rest = np.setdiff1d(np.arange(0, d.n_items + 1), start.items)
    assert not table[rest].any()                                   # padding and the other items start at 0
    ln = began["params"]["ln_f"]
    np.testing.assert_array_equal(np.asarray(ln["scale"]), np.concatenate([emb.signs, [0.0]]))
    np.testing.assert_allclose(np.asarray(ln["bias"]), np.concatenate([np.zeros(7), [np.sqrt(8)]]), rtol=1e-6)
    assert not np.asarray(began["params"]["pos_embed"]["embedding"]).any()
    for b in ("block0", "block1"):  # residual branches off: each block passes its input through unchanged
        assert not np.asarray(began["params"][b]["attn"]["out"]["kernel"]).any()
        assert not np.asarray(began["params"][b]["fc2"]["kernel"]).any()
    seq = np.zeros((2, d.maxlen), np.int32)
    seq[:, -3:] = rest[1]
    seq[0, -1] = start.items[2]                                    # last item a candidate
    scores = np.asarray(model.apply(began, jnp.asarray(seq))[:, -1])
    x = table[seq[0, -1]] * np.sqrt(8)
    z = (x - x.mean()) / np.sqrt(x.var() + 1e-6) * np.asarray(ln["scale"]) + np.asarray(ln["bias"])
    np.testing.assert_allclose(scores[0, 1:], (z @ table.T)[1:], rtol=2e-4, atol=2e-5)   # the release's geometry
    np.testing.assert_allclose(scores[1, start.items], prior, rtol=1e-5, atol=1e-5)     # popularity only
    assert not scores[1, rest[1:]].any()
    res = train.train(d, cfg, jax.random.key(2), progress=False, evaluate_test=False)
    assert [r.name for r in res.privacy.releases][-3:] == ["item popularity (per-user norm 1)",
                                                            "item transition sums (per-user Frobenius norm 1)",
                                                            "DP-SGD step (Poisson-sampled Gaussian)"]
    assert res.privacy.epsilon() == pytest.approx(4.0, rel=1e-3)
    plain = train.privacy_setup(d, dataclasses.replace(cfg, item_init="random", item_init_k=None), jax.random.key(2))
    assert plain.noise_multiplier < res.noise_multiplier     # the release's share of ε is paid by DP-SGD's noise
    exact = train.privacy_setup(d, dataclasses.replace(cfg, epsilon=None), jax.random.key(2)).item_start
    assert exact.report is None and exact.noise_multiplier == 0.0  # the NON-PRIVATE reference: exact transitions


def test_privacy_setup_uses_dp_sgds_calibration_and_report_line():
    # sigma from DP-SGD's calibration composed after the releases before training, the steps' line from DP-SGD's
    from jdp.clipping.dp_sgd import dp_sgd_release
    d = _toy()
    cfg = train.TrainConfig(model="dpformer", epsilon=4.0, epochs=1.0, batch_size=16, d=8, blocks=1)
    rep, sigma, _, _ = train.privacy_setup(d, cfg, jax.random.key(0))
    _, q, steps = train.sampling_plan(d, cfg)
    before = [r.composed_event() for r in rep.releases[:-1]]
    assert sigma == jc.calibrate_noise_multiplier(4.0, cfg.delta, q, steps, before=before)
    assert rep.releases[-1] == dp_sgd_release(sigma, q, cfg.l2_clip, steps, name=train.DP_SGD_STEP)
    assert rep.epsilon() == pytest.approx(4.0, abs=1e-3)


@pytest.mark.slow
def test_optimizers_for_dp_noise_get_the_runs_public_noise_variance():
    """`TrainConfig(optimizer=...)`: DP-AdamBC receives φ = (σC/B)² of the run's calibrated σ (public), SGD with
    momentum and AdamW need none; the same privacy report whatever the optimiser (post-processing)."""
    from jdp.clipping import dp_adam_bc, noise_variance
    from jdp.seqrec import prepare
    d = _toy()
    base = dict(model="gru", epsilon=4.0, epochs=1.0, batch_size=16, chunk_rows=256, d=8, lr=1e-2, eval_chunk=32,
                length_buckets=())
    runs = {name: train.train(d, train.TrainConfig(optimizer=name, **base), jax.random.key(0), progress=False)
            for name in ("adamw", "adam-bc", "sgd-momentum")}
    assert len({r.privacy.epsilon() for r in runs.values()}) == 1
    assert len({r.noise_multiplier for r in runs.values()}) == 1
    sigma = runs["adam-bc"].noise_multiplier
    phi = noise_variance(sigma, 1.0, 16)
    cfg = train.TrainConfig(optimizer="adam-bc", adam_bc_gamma=3.0, **base)
    g = {"w": jnp.linspace(-1e-2, 1e-2, 5)}
    got = prepare.optimizer(cfg, 3, phi)
    want = dp_adam_bc(prepare.lr_schedule(1e-2, 3, cfg.warmup_frac), phi, gamma_over_noise=3.0, weight_decay=1e-5)
    s_got, s_want = got.init(g), want.init(g)
    for _ in range(2):  # the schedule starts at 0: the second step moves
        u_got, s_got = got.update(g, s_got, g)
        u_want, s_want = want.update(g, s_want, g)
    assert np.abs(np.asarray(u_got["w"])).max() > 0
    np.testing.assert_array_equal(np.asarray(u_got["w"]), np.asarray(u_want["w"]))
    for bad in ({"optimizer": "lamb"}, {"adam_bc_gamma": 0.0}):
        with pytest.raises(ValueError, match="optimizer|adam_bc_gamma"):
            train.TrainConfig(**bad).validate()


@pytest.mark.slow  # three trainings (17 s); the mechanism itself: tests/clipping/test_sparse_rows.py
def test_sparse_item_rows_update_only_selected_rows_at_the_same_epsilon():
    """`TrainConfig(sparse_item_rows=True)` (DP-FEST on the item table): the same σ and ε as plain DP-SGD, the
    report names the step; with a threshold no noisy count reaches, the item table never moves while the rest of
    the model trains (an unselected row's gradient and noise are exactly 0, so momentum never moves it); with one
    every count passes, it moves."""
    d = _toy()
    base = dict(model="transformer", epsilon=4.0, epochs=1.0, batch_size=16, chunk_rows=256, d=8, blocks=1, lr=1e-1,
                eval_chunk=32, length_buckets=(), optimizer="sgd-momentum", weight_decay=0.0, item_init="random")
    key = jax.random.key(0)
    plain = train.train(d, train.TrainConfig(**base), key, progress=False, evaluate_test=False)
    fest = train.train(d, train.TrainConfig(sparse_item_rows=True, sparse_threshold=-1e6, **base), key,
                       progress=False, evaluate_test=False)  # every row selected
    assert fest.noise_multiplier == plain.noise_multiplier
    assert fest.privacy.epsilon() == pytest.approx(plain.privacy.epsilon(), rel=1e-12)
    assert fest.privacy.releases[-1].name == train.DP_FEST_STEP
    never = train.train(d, train.TrainConfig(sparse_item_rows=True, sparse_threshold=1e6, **base), key,
                        progress=False, evaluate_test=False)
    start = train.train(d, train.TrainConfig(sparse_item_rows=True, sparse_threshold=1e6, **base), key,
                        progress=False, evaluate_test=False, max_steps=0).params
    emb = lambda p: np.asarray(p["params"]["item_embed"]["embedding"])  # noqa: E731
    np.testing.assert_array_equal(emb(never.params), emb(start))
    assert not np.array_equal(emb(fest.params), emb(start))
    assert not np.allclose(never.params["params"]["ln_f"]["scale"], start["params"]["ln_f"]["scale"])
    for bad in ({"sparse_item_rows": True, "model": "gru"}, {"sparse_item_rows": True, "freeze_item_table": True},
                {"sparse_ratio": 0.0}, {"sparse_threshold": float("nan")}):
        with pytest.raises(ValueError, match="sparse"):
            train.TrainConfig(**bad).validate()


def test_the_default_item_start_is_the_transition_release_where_it_fits():
    """`item_init="auto"` (the default): a private DPFormer / Transformer starts from the transition release with
    K from the public rule (`transitions.default_k`), the other models, the NON-PRIVATE reference and a private run
    whose ε is too small for the start's releases from a random start; an explicit choice is kept."""
    from jdp.seqrec import releases
    d = _toy(n_users=200)
    small = dict(batch_size=16, epochs=1.0, d=8)
    for model, eps, want in [("dpformer", 8.0, "transitions"), ("transformer", 8.0, "transitions"),
                             ("gru", 8.0, "random"), ("transformer-untied", 8.0, "random"),
                             ("dpformer", None, "random")]:
        assert train.TrainConfig(model=model, epsilon=eps, **small).item_start() == want
    assert train.TrainConfig(model="transformer", norm="post", **small).item_start() == "random"
    assert train.TrainConfig(item_init="random", **small).item_start() == "random"
    setup = releases.privacy_setup(d, train.TrainConfig(model="transformer", epsilon=8.0, **small), jax.random.key(0))
    names = [r.name for r in setup.report.releases]
    assert names[-3:-1] == ["item popularity (per-user norm 1)", "item transition sums (per-user Frobenius norm 1)"]
    sigma_t = setup.report.releases[-2].noise_scale
    assert setup.item_start.items.size == transitions.default_k(d.n_users, sigma_t, d.n_items)
    tiny = releases.privacy_setup(d, train.TrainConfig(model="transformer", epsilon=1.0, **small), jax.random.key(0))
    assert tiny.item_start is None and len(tiny.report.releases) == 1  # only the DP-SGD steps
    with pytest.raises(ValueError, match="cannot reach"):  # asked for explicitly, it is never dropped
        releases.privacy_setup(d, train.TrainConfig(model="transformer", epsilon=1.0, item_init="transitions",
                                                    **small), jax.random.key(0))


def test_the_default_adds_the_transition_prior_and_spends_most_of_epsilon_on_its_release():
    """`transition_prior=None` (the default): on wherever the run starts from the release with a full softmax; the
    item releases alone then spend PRIOR_EPSILON_SHARE of ε, ITEM_INIT_EPSILON_SHARE without the prior. An "auto"
    start that cannot fit in its share runs without either; a prior asked for there is refused."""
    from dp_accounting.dp_event import ComposedDpEvent

    from jdp.seqrec import releases
    d = _toy(n_users=200)
    small = dict(batch_size=16, epochs=1.0, d=8)
    for kw, want in [({}, True), ({"model": "transformer"}, True), ({"model": "gru"}, False),
                     ({"epsilon": None}, False), ({"negatives": 5}, False), ({"item_init": "random"}, False),
                     ({"transition_prior": False}, False), ({"transition_prior": True}, True)]:
        assert train.TrainConfig(**{**small, **kw}).uses_transition_prior() is want, kw
    for prior, share in [(None, train.PRIOR_EPSILON_SHARE), (False, train.ITEM_INIT_EPSILON_SHARE)]:
        cfg = train.TrainConfig(model="transformer", epsilon=8.0, transition_prior=prior, **small)
        assert cfg.item_init_epsilon_share() == share
        report = releases.privacy_setup(d, cfg, jax.random.key(0)).report
        items = [r.composed_event() for r in report.releases if r.name != train.DP_SGD_STEP]
        assert len(items) == 2  # the item popularity and the transition sums
        assert accounting.compute_epsilon(ComposedDpEvent(items), report.delta) == pytest.approx(8.0 * share, rel=1e-2)
        assert report.epsilon() <= 8.0 + 1e-3
    tiny = train.TrainConfig(model="transformer", epsilon=1.0, **small)  # the item releases alone exceed 0.85
    assert tiny.uses_transition_prior() and not releases.uses_transition_prior(tiny, False)
    assert releases.privacy_setup(d, tiny, jax.random.key(0)).item_start is None
    asked = dataclasses.replace(tiny, transition_prior=True)
    for refuse in (lambda: releases.uses_transition_prior(asked, False),  # `prepare`: before the model is built
                   lambda: releases.privacy_setup(d, asked, jax.random.key(0))):
        with pytest.raises(ValueError, match="transition_prior needs"):
            refuse()
    with pytest.raises(ValueError, match="transition_prior"):
        train.TrainConfig(transition_prior="yes").validate()


def test_dropout_defaults_by_the_start_and_the_model_is_built_with_it(monkeypatch):
    """`dropout=None` (the default): PRIOR_DROPOUT where the run adds the transition prior (as `releases` resolves
    it: not where an "auto" start falls back to random), else the paper's DROPOUT; a given rate is kept, a rate
    outside [0, 1) refused."""
    from jdp.seqrec import prepare as prep
    assert (train.PRIOR_DROPOUT, train.DROPOUT) == (0.2, 0.5)
    cfg = train.TrainConfig()
    assert cfg.dropout is None and cfg.dropout_rate(True) == 0.2 and cfg.dropout_rate(False) == 0.5
    given = train.TrainConfig(dropout=0.3)
    assert given.dropout_rate(True) == 0.3 == given.dropout_rate(False)
    assert train.TrainConfig(dropout=0.0).dropout_rate(True) == 0.0
    for bad in (1.0, -0.1, "0.2", float("nan"), False):
        with pytest.raises(ValueError, match="dropout"):
            train.TrainConfig(dropout=bad).validate()
    built = []

    def stop_after_the_model(*a, **k):
        built.append(a[6])  # make_model's dropout argument
        raise RuntimeError("stop")
    monkeypatch.setattr(prep, "make_model", stop_after_the_model)
    d = _toy(n_users=200)
    for kw, want in [({}, 0.2), ({"epsilon": 1.0}, 0.5), ({"item_init": "random"}, 0.5), ({"dropout": 0.1}, 0.1)]:
        with pytest.raises(RuntimeError, match="stop"):
            train.train(d, train.TrainConfig(**{"batch_size": 16, "epochs": 1.0, "d": 8, **kw}), jax.random.key(0))
        assert built[-1] == want, kw


@pytest.mark.parametrize("name", ["dpformer", "transformer-untied", "gru"])
def test_padding_column_is_neg_and_passes_no_gradient(name):
    """The output's column 0 (padding, never a target) is NEG at every position, and nothing flows back from it:
    a cotangent on that column alone gives zero gradients (the select that sets it, `models._output`)."""
    model = models.make_model(name, n_items=9, maxlen=5, d=8, dropout=0.0)
    x = jnp.asarray([[0, 3, 1, 4, 2], [0, 0, 0, 5, 6]], jnp.int32)
    params = model.init(jax.random.key(0), x)
    logits, vjp = jax.vjp(lambda p: model.apply(p, x, deterministic=True), params)
    np.testing.assert_array_equal(logits[..., 0], models.NEG)
    assert bool(jnp.all(logits[..., 1:] > models.NEG / 2))
    grads = vjp(jnp.zeros_like(logits).at[..., 0].set(1.0))[0]
    for g in jax.tree.leaves(grads):
        np.testing.assert_array_equal(g, 0.0)


def test_transition_prior_is_the_releases_scores_in_units_of_its_noise():
    """`transition_prior` at every position = log(1 + max(s, 0)) of `TransitionModel.scores`' candidate scores s
    (without their popularity tie-break) over the position's last 3 items, divided by the release's noise std; 0 for
    every other item and for a position without a candidate among its last 3 items; `last_only` = the last row."""
    d = _toy(n_users=64)
    release = transitions.release(d, 6, jax.random.key(3), accounting.PrivacyReport(1e-5), 0.7)
    inputs = release.prior_inputs()
    assert inputs["prior_table"].shape == (7, d.n_items + 1) and inputs["prior_slot"].shape == (d.n_items + 1,)
    seq = np.asarray(d.train_input[:16])
    prior = np.asarray(models.transition_prior(jnp.asarray(seq), jnp.asarray(inputs["prior_slot"]),
                                               jnp.asarray(inputs["prior_table"])))
    tiebreak = release.counts / (1.0 + np.abs(release.counts).max()) * 1e-6
    others = np.setdiff1d(np.arange(d.n_items + 1), release.items)
    for t in range(seq.shape[1]):
        s = release.scores(seq[:, :t + 1])[:, release.items] - tiebreak[release.items]
        np.testing.assert_allclose(prior[:, t, release.items], np.log1p(np.maximum(s / 0.7, 0.0)), rtol=1e-5,
                                   atol=1e-6)
        assert not prior[:, t, others].any()
    last = models.transition_prior(jnp.asarray(seq), jnp.asarray(inputs["prior_slot"]),
                                   jnp.asarray(inputs["prior_table"]), last_only=True)
    np.testing.assert_allclose(np.asarray(last)[:, 0], prior[:, -1], rtol=1e-6)


@pytest.mark.parametrize("name", ["dpformer", "transformer"])
def test_a_transition_prior_model_is_clipped_like_naive_per_example_clipping(name):
    # the prior enters through a Dense(1) site over every (position, item): its learned scale is tapped, not vmapped
    d = _toy()
    release = transitions.release(d, 6, jax.random.key(3), accounting.PrivacyReport(1e-5), 0.7)
    model = models.make_model(name, d.n_items, d.maxlen, d=8, heads=1, blocks=1, dropout=0.0, prior=True)
    params = jax.jit(model.init)(jax.random.key(0), jnp.asarray(d.train_input[:2]))
    assert float(params["params"]["prior_scale"]["kernel"][0, 0]) == 1.0
    aux = {k: jnp.asarray(v) for k, v in release.prior_inputs().items()}
    if name == "dpformer":
        aux.update({"w_var": 1e-4, "emb_var": jnp.full((d.n_items + 1,), 1e-2)})
    batch = {"input": jnp.asarray(d.train_input[:8]), "target": jnp.asarray(d.train_target[:8]),
             "key": jax.random.split(jax.random.key(1), 8)}
    loss_fn = models.make_loss_fn(model, aux, deterministic=True)
    _assert_equals_naive_clipping(loss_fn, params, batch, "auto")
    assert jc.explain(loss_fn, params, batch)[-1]["fallback"] == []
    plain = models.make_model(name, d.n_items, d.maxlen, d=8, heads=1, blocks=1, dropout=0.0)
    without = {"params": {k: v for k, v in params["params"].items() if k != "prior_scale"}}
    diff = model.apply(params, batch["input"], reatt=aux) - plain.apply(without, batch["input"], reatt=aux)
    want = models.transition_prior(batch["input"], aux["prior_slot"], aux["prior_table"])
    np.testing.assert_allclose(np.asarray(diff)[..., 1:], np.asarray(want)[..., 1:], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="prior_table"):  # applied without its prior: refused, not scored without it
        model.apply(params, batch["input"])
