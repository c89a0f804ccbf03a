"""clipped_grad equals the per-example vmap(grad) reference (float32, rel. err <= 1e-4)."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp.clipping as jc

TOL = 1e-4


# ------------------------------------------------------------------------------------------ models
class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16)(x))
        h = nn.tanh(nn.Dense(8)(h))
        return nn.Dense(3)(h)


class Transformer(nn.Module):
    vocab: int = 30
    dim: int = 8
    max_len: int = 12
    tied: bool = True

    @nn.compact
    def __call__(self, ids):
        emb = nn.Embed(self.vocab, self.dim)
        h = emb(ids) + nn.Embed(self.max_len, self.dim)(jnp.arange(ids.shape[1]))[None]
        for _ in range(2):
            y = nn.LayerNorm()(h)
            h = h + nn.MultiHeadDotProductAttention(num_heads=2)(y, mask=nn.make_causal_mask(ids))
            y = nn.LayerNorm()(h)
            h = h + nn.Dense(self.dim)(nn.gelu(nn.Dense(2 * self.dim)(y)))
        h = nn.LayerNorm()(h)
        return emb.attend(h) if self.tied else nn.Dense(self.vocab)(h)


class RNN(nn.Module):
    cell: str = "gru"
    scan: bool = True

    @nn.compact
    def __call__(self, ids):
        emb = nn.Embed(20, 6)
        h = emb(ids)
        cell = nn.GRUCell(8) if self.cell == "gru" else nn.OptimizedLSTMCell(8)
        if self.scan:
            h = nn.RNN(cell)(h)
        else:  # unrolled: the cell's Dense kernels are shared by every time step (cross-site terms)
            carry = cell.initialize_carry(jax.random.PRNGKey(0), h[:, 0].shape)
            outs = []
            for t in range(h.shape[1]):
                carry, o = cell(carry, h[:, t])
                outs.append(o)
            h = jnp.stack(outs, 1)
        return emb.attend(nn.Dense(6)(h))


class Custom(nn.Module):
    @nn.compact
    def __call__(self, x):
        s = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        return x * s + jnp.sin(x)


class SharedMLP(nn.Module):
    """One Dense module applied at two different places + a custom (unrecognised) layer."""

    @nn.compact
    def __call__(self, x):
        shared = nn.Dense(5, name="shared")
        h = nn.relu(shared(nn.Dense(5)(x)))
        h = Custom()(h)
        return nn.Dense(3)(shared(h))


# ------------------------------------------------------------------------------------------ helpers
def xent(model, seq=False):
    def loss_fn(p, b):
        lp = jax.nn.log_softmax(model.apply({"params": p}, b["x"]))
        nll = -jnp.take_along_axis(lp, b["y"][..., None], -1)[..., 0]
        return nll.reshape(nll.shape[0], -1).sum(-1)
    return loss_fn


def seq_batch(B, L, vocab, seed=0, pad_id=None):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.randint(k1, (B, L), 0, min(vocab, 6))   # few distinct ids: repeated tokens
    if pad_id is not None:
        x = x.at[0, :3].set(pad_id)
    y = jax.random.randint(k2, (B, L), 0, vocab)
    return {"x": x, "y": y}


CPU_CHUNK_RULE = pytest.mark.skipif(jax.default_backend() != "cpu",
                                    reason="the CPU rule of batch_chunk='auto' (on GPU/TPU: the whole batch)")

_PER_EXAMPLE = {}


def per_example(loss_fn, params, batch):
    key = (loss_fn, id(params), id(batch))
    if key not in _PER_EXAMPLE:
        per = jax.jit(functools.partial(jc.per_example_grads_reference, loss_fn))(params, batch)
        _PER_EXAMPLE[key] = (params, batch, [np.asarray(x, np.float64) for x in jax.tree.leaves(per)])
    return _PER_EXAMPLE[key][2]


def reference(loss_fn, params, batch, C, mask=None, group_ids=None, num_groups=None, normalize=False,
              labels=None, Cs=None):
    """Per-example grads by vmap(grad), then clip in numpy."""
    leaves = per_example(loss_fn, params, batch)
    B = leaves[0].shape[0]
    w = np.ones(B) if mask is None else np.asarray(mask, np.float64)
    if group_ids is None:
        A = np.diag(w)
    else:
        A = np.zeros((num_groups, B))
        A[np.asarray(group_ids), np.arange(B)] = w
    units = [np.tensordot(A, x, axes=1) for x in leaves]          # per-unit gradients
    labels = [0] * len(units) if labels is None else labels
    K = max(labels) + 1
    Cs = [C / np.sqrt(K)] * K if Cs is None else Cs
    gn = np.zeros((A.shape[0], K))
    for u, lab in zip(units, labels):
        gn[:, lab] += (u.reshape(u.shape[0], -1) ** 2).sum(1)
    gn = np.sqrt(gn)
    if normalize:
        f = np.array(Cs)[None] / np.maximum(gn, 1e-12)
    else:
        f = np.minimum(1.0, np.array(Cs)[None] / np.maximum(gn, 1e-12))
    f = f * (A.sum(1) > 0)[:, None]
    out = [np.tensordot(f[:, lab], u, axes=1) for u, lab in zip(units, labels)]
    norms = np.sqrt((gn ** 2).sum(1)) * (A.sum(1) > 0)
    return out, norms


def check(cg, ref_sum, ref_norms):
    got = [np.asarray(x, np.float64) for x in jax.tree.leaves(cg.grad_sum)]
    diff = np.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(got, ref_sum)))
    scale = np.sqrt(sum((b ** 2).sum() for b in ref_sum))
    assert scale > 0
    assert diff / scale <= TOL, diff / scale
    for a, b in zip(got, ref_sum):   # every leaf, relative to the global scale
        assert np.abs(a - b).max() <= TOL * scale
    np.testing.assert_allclose(np.asarray(cg.norms), ref_norms, rtol=TOL, atol=1e-6)


def run(loss_fn, params, batch, **kw):
    fn = jax.jit(functools.partial(jc.clipped_grad, loss_fn, **kw))
    return fn(params, batch)


def setup(model, batch, init_input, init_seed, clip_scale=1.0):
    """(params, loss_fn, C) with C = clip_scale × the median unclipped per-example norm (some get clipped)."""
    params = model.init(jax.random.PRNGKey(init_seed), init_input)["params"]
    loss_fn = xent(model)
    return params, loss_fn, clip_scale * float(np.median(reference(loss_fn, params, batch, 1e6)[1]))


# ------------------------------------------------------------------------------------------ tests
def test_mlp_all_methods():
    model = MLP()
    x = jax.random.normal(jax.random.PRNGKey(0), (6, 7))
    batch = {"x": x, "y": jnp.array([0, 1, 2, 0, 1, 2])}
    params, loss_fn, C = setup(model, batch, x, 1)        # half the examples get clipped
    ref_sum, ref_norms = reference(loss_fn, params, batch, C)
    for method in ("auto", "ghost", "ghost-two-pass", "vmap"):
        check(run(loss_fn, params, batch, l2_clip=C, method=method), ref_sum, ref_norms)
    assert jc.explain(loss_fn, params, batch)[-1]["fallback"] == []


@pytest.mark.parametrize("cfg", [
    pytest.param(dict(vocab=30, dim=8, L=6, memory_limit=1 << 30, method="ghost", users=True),  # Phantom
                 marks=pytest.mark.slow),  # the tied DPFormer in tests/seqrec/test_train.py covers Phantom by default
    pytest.param(dict(vocab=10, dim=4, L=12, memory_limit=2000, method="auto", users=False),  # instantiated, chunked
                 marks=pytest.mark.slow),
])
def test_tied_transformer(cfg):
    model = Transformer(vocab=cfg["vocab"], dim=cfg["dim"], max_len=cfg["L"], tied=True)
    batch = seq_batch(5, cfg["L"], cfg["vocab"], pad_id=0)
    params, loss_fn, C = setup(model, batch, batch["x"], 1, clip_scale=0.5)
    mask = jnp.array([True, True, False, True, True])
    ref_sum, ref_norms = reference(loss_fn, params, batch, C, mask=mask)
    check(run(loss_fn, params, batch, l2_clip=C, mask=mask, memory_limit=cfg["memory_limit"], method=cfg["method"]),
          ref_sum, ref_norms)
    if cfg["users"]:  # user-level: examples 0,3 and 1,4 belong to the same user; example 2 is padding
        gids = jnp.array([0, 1, 2, 0, 1])
        ref_sum, ref_norms = reference(loss_fn, params, batch, C, mask=mask, group_ids=gids, num_groups=3)
        check(run(loss_fn, params, batch, l2_clip=C, mask=mask, group_ids=gids, num_groups=3, method=cfg["method"]),
              ref_sum, ref_norms)
    plan = jc.explain(loss_fn, params, batch)
    assert plan[-1]["fallback"] == [] and plan[-1]["fallback_bytes"] == 0
    assert [r["method"] for r in plan[:-1] if r.get("layer") == "Embed"].count("attend") == 1


@pytest.mark.slow
def test_untied_transformer_two_pass():
    model = Transformer(tied=False)
    batch = seq_batch(4, 6, 30, seed=3)
    params, loss_fn, C = setup(model, batch, batch["x"], 2, clip_scale=0.5)
    ref_sum, ref_norms = reference(loss_fn, params, batch, C)
    check(run(loss_fn, params, batch, l2_clip=C, method="ghost-two-pass"), ref_sum, ref_norms)


@pytest.mark.slow
@pytest.mark.parametrize("cell,scan,fallback", [
    ("gru", True, True), pytest.param("lstm", True, True, marks=pytest.mark.slow), ("gru", False, False)])
def test_recurrent(cell, scan, fallback):
    model = RNN(cell, scan)
    batch = seq_batch(4, 5, 20, seed=1)
    params, loss_fn, C = setup(model, batch, batch["x"], 0)
    ref_sum, ref_norms = reference(loss_fn, params, batch, C)
    check(run(loss_fn, params, batch, l2_clip=C), ref_sum, ref_norms)
    fb = jc.explain(loss_fn, params, batch)[-1]["fallback"]
    assert bool(fb) == fallback
    assert all("Cell" in p for p in fb)    # the embedding and output layer stay tapped


@pytest.mark.slow
def test_custom_layer_and_shared_parameter():
    model = SharedMLP()
    x = jax.random.normal(jax.random.PRNGKey(3), (6, 7))
    batch = {"x": x, "y": jnp.array([0, 1, 2, 2, 1, 0])}
    params, loss_fn, C = setup(model, batch, x, 0)
    ref_sum, ref_norms = reference(loss_fn, params, batch, C)
    check(run(loss_fn, params, batch, l2_clip=C), ref_sum, ref_norms)
    plan = jc.explain(loss_fn, params, batch)
    assert plan[-1]["fallback"] == ["['Custom_0']['scale']"]
    assert plan[-1]["fallback_bytes"] == 4 * 6 * 5      # B x size x float32
    assert plan[-1]["leaves"]["['Custom_0']['scale']"]["norm"] == "fallback"
    shared_sites = [r for r in plan[:-1] if "['shared']['kernel']" in r["params"]]
    assert len(shared_sites) == 2 and all(r["tapped"] for r in shared_sites)

    # The same parameter also read outside any layer (an L2 penalty in the loss): must fall back.
    def loss_reg(p, b):
        return loss_fn(p, b) + 0.1 * jnp.sum(p["shared"]["kernel"] ** 2) * jnp.sum(b["x"] ** 2, axis=1)

    ref_sum, ref_norms = reference(loss_reg, params, batch, C)
    check(run(loss_reg, params, batch, l2_clip=C), ref_sum, ref_norms)
    fb = jc.explain(loss_reg, params, batch)[-1]["fallback"]
    assert "['shared']['kernel']" in fb and "['shared']['bias']" in fb


class HandTiedLM(nn.Module):
    """Tying written by hand, as Flax users write it: logits = h @ embedding.T (no Embed.attend)."""
    vocab: int = 20
    dim: int = 6

    @nn.compact
    def __call__(self, ids):
        emb = nn.Embed(self.vocab, self.dim)
        h = emb(ids)
        h = nn.LayerNorm()(h + nn.Dense(self.dim)(nn.gelu(h)))
        return h @ emb.embedding.T


class TiedAutoencoder(nn.Module):
    """A decoder that reads the encoder's kernel: z = tanh(x W + b), x̂ = z Wᵀ (and one W-side product, W z')."""

    @nn.compact
    def __call__(self, x):
        enc = nn.Dense(4, name="enc")
        z = jnp.tanh(enc(x))
        w = enc.variables["params"]["kernel"]                       # [7, 4]
        return z @ w.T + 0.1 * jnp.einsum("pq,bq->bp", w, z ** 2)   # second product: the kernel as lhs


@pytest.mark.slow
@pytest.mark.parametrize("model,make", [
    (HandTiedLM(), lambda: seq_batch(5, 6, 20, seed=3)),
    (TiedAutoencoder(), lambda: {"x": jax.random.normal(jax.random.PRNGKey(5), (6, 7))}),
])
def test_parameter_read_directly_in_a_matmul_is_tapped(model, make):
    """`h @ E.T` / `z @ W.T` outside any layer: the parameter is tapped at each product (with its layer sites,
    Phantom-style for the tied embedding) instead of sent whole to the vmap fallback; exact for every method."""
    batch = make()
    if "y" in batch:
        params, loss_fn, C = setup(model, batch, batch["x"], 0, clip_scale=0.5)
    else:
        params = model.init(jax.random.PRNGKey(0), batch["x"])["params"]

        def loss_fn(p, b):
            return jnp.sum((model.apply({"params": p}, b["x"]) - b["x"]) ** 2, axis=-1)
        C = 0.5 * float(np.median(reference(loss_fn, params, batch, 1e6)[1]))
    ref_sum, ref_norms = reference(loss_fn, params, batch, C)
    for method in ("auto", "ghost", "ghost-two-pass", "bk"):
        check(run(loss_fn, params, batch, l2_clip=C, method=method), ref_sum, ref_norms)
    plan = jc.explain(loss_fn, params, batch)
    assert plan[-1]["fallback"] == [] and plan[-1]["fallback_bytes"] == 0
    assert plan[-1]["raw_products"]

    # the same parameter also read outside any product (a penalty): the whole parameter falls back, exactly
    def loss_reg(p, b):
        leaf = p["Embed_0"]["embedding"] if "Embed_0" in p else p["enc"]["kernel"]
        return loss_fn(p, b) + 0.01 * jnp.sum(leaf ** 2)

    ref_sum, ref_norms = reference(loss_reg, params, batch, C)
    check(run(loss_reg, params, batch, l2_clip=C), ref_sum, ref_norms)
    assert jc.explain(loss_reg, params, batch)[-1]["fallback"]


def test_normalized_and_per_layer_clipping():
    model = MLP()
    x = jax.random.normal(jax.random.PRNGKey(4), (5, 7))
    batch = {"x": x, "y": jnp.array([0, 1, 2, 0, 1])}
    params = model.init(jax.random.PRNGKey(1), x)["params"]
    loss_fn = xent(model)
    ref_sum, ref_norms = reference(loss_fn, params, batch, 0.3, normalize=True)
    cg = run(loss_fn, params, batch, l2_clip=0.3, normalize=True)
    check(cg, ref_sum, ref_norms)
    # every example contributes exactly norm C
    per = per_example(loss_fn, params, batch)
    clipped = np.sqrt(sum((g.reshape(5, -1) ** 2).sum(1) for g in per)) * np.asarray(cg.clip_factors)
    np.testing.assert_allclose(clipped, 0.3, rtol=1e-5)
    # per-layer: one group per Dense module, thresholds split equally
    paths = [jax.tree_util.keystr(p[:-1]) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    order = list(dict.fromkeys(paths))
    labels = [order.index(p) for p in paths]
    ref_sum, ref_norms = reference(loss_fn, params, batch, 0.3, labels=labels)
    cg = run(loss_fn, params, batch, l2_clip=0.3, clip_partition="per_layer")
    check(cg, ref_sum, ref_norms)
    assert cg.group_norms.shape == (5, 3)
    np.testing.assert_allclose(cg.sensitivity, 0.3, rtol=1e-6)
    cg = run(loss_fn, params, batch, l2_clip={"['Dense_0']": 1.0, "['Dense_1']": 0.5, "['Dense_2']": 0.25},
             clip_partition="per_layer")
    ref_sum, ref_norms = reference(loss_fn, params, batch, None, labels=labels, Cs=[1.0, 0.5, 0.25])
    check(cg, ref_sum, ref_norms)
    np.testing.assert_allclose(cg.sensitivity, np.sqrt(1 + 0.25 + 0.0625), rtol=1e-6)


@pytest.mark.slow
def test_the_sensitivity_is_derived_once_whatever_the_path():
    # whole batch, a loop over chunks, group_ids units and per-layer groups: ClippedGrad.sensitivity_of each time
    model = MLP()
    x = jax.random.normal(jax.random.PRNGKey(4), (6, 7))
    batch = {"x": x, "y": jnp.array([0, 1, 2, 0, 1, 2])}
    params = model.init(jax.random.PRNGKey(1), x)["params"]
    loss_fn = xent(model)
    Cs = {"['Dense_0']": 1.0, "['Dense_1']": 0.5, "['Dense_2']": 0.25}
    for kw in ({"batch_chunk": None}, {"batch_chunk": 4}, {"group_ids": jnp.array([0, 1, 0, 1, 2, 2])}):
        cg = jc.clipped_grad(loss_fn, params, batch, l2_clip=0.3, **kw)
        assert cg.sensitivity == jc.ClippedGrad.sensitivity_of([0.3]) == pytest.approx(0.3, rel=1e-12)
        cg = jc.clipped_grad(loss_fn, params, batch, l2_clip=Cs, clip_partition="per_layer", **kw)
        assert cg.sensitivity == jc.ClippedGrad.sensitivity_of(list(Cs.values()))
        assert cg.partition_labels == tuple(Cs)


def test_padding_mask_matches_subset():
    model = MLP()
    x = jax.random.normal(jax.random.PRNGKey(5), (6, 7))
    batch = {"x": x, "y": jnp.array([0, 1, 2, 0, 1, 2])}
    params = model.init(jax.random.PRNGKey(1), x)["params"]
    loss_fn = xent(model)
    keep = np.array([0, 2, 3])
    mask = jnp.zeros(6, bool).at[keep].set(True)
    padded = dict(batch, x=batch["x"].at[~mask].set(1e3))          # garbage (finite) padding rows
    full = run(loss_fn, params, padded, l2_clip=0.1, mask=mask)
    sub = run(loss_fn, params, jax.tree.map(lambda a: a[keep], batch), l2_clip=0.1)
    for a, b in zip(jax.tree.leaves(full.grad_sum), jax.tree.leaves(sub.grad_sum)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(full.norms)[~np.asarray(mask)] == 0)
    assert np.all(np.asarray(full.clip_factors)[~np.asarray(mask)] == 0)


def test_bad_inputs():
    model = MLP()
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 7))
    batch = {"x": x, "y": jnp.array([0, 1, 2, 0])}
    params = model.init(jax.random.PRNGKey(1), x)["params"]
    loss_fn = xent(model)
    for C in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="l2_clip"):
            jc.clipped_grad(loss_fn, params, batch, l2_clip=C)
    with pytest.raises(ValueError, match="mismatched"):
        jc.clipped_grad(loss_fn, params, {"x": x, "y": jnp.array([0, 1, 2])}, l2_clip=1.0)
    with pytest.raises(ValueError, match="mask"):
        jc.clipped_grad(loss_fn, params, batch, l2_clip=1.0, mask=jnp.ones(3, bool))
    with pytest.raises(ValueError, match="group_ids"):
        jc.clipped_grad(loss_fn, params, batch, l2_clip=1.0, group_ids=jnp.array([0, 1, 5, 0]), num_groups=3)
    with pytest.raises(ValueError, match="method"):
        jc.clipped_grad(loss_fn, params, batch, l2_clip=1.0, method="fast")
    with pytest.raises(ValueError, match="per-example losses"):
        jc.clipped_grad(lambda p, b: jnp.sum(loss_fn(p, b)), params, batch, l2_clip=1.0)
    # a non-finite example is a property of the private data: never raised on (eagerly or under jit), it is
    # counted in the returned private diagnostic and gets factor 0
    cg = jc.clipped_grad(lambda p, b: loss_fn(p, b) * jnp.where(b["y"] == 2, jnp.nan, 1.0), params, batch,
                         l2_clip=1.0)
    assert int(cg.num_nonfinite) == 1 and float(cg.clip_factors[2]) == 0.0
    cg = jax.jit(lambda p, b: jc.clipped_grad(
        lambda p, b: loss_fn(p, b) * jnp.where(b["y"] == 2, jnp.inf, 1.0), p, b, l2_clip=1.0))(params, batch)
    assert int(cg.num_nonfinite) == 1 and float(cg.clip_factors[2]) == 0.0


@pytest.mark.slow
@CPU_CHUNK_RULE
def test_batch_chunk_runs_the_batch_in_chunks_with_the_same_result(monkeypatch):
    """"auto" on CPU: chunks of a power of two ≥ MIN_CHUNK examples whose per-example state is about
    CPU_CHUNK_BYTES (shrunk here so that a batch of 7 splits into chunks of 2, the last one padded); exact
    against vmap(grad) like the whole batch, reported by `explain`; bad values raise."""
    from jdp.clipping import engine
    model = MLP()
    x = jax.random.normal(jax.random.PRNGKey(0), (7, 7))
    batch = {"x": x, "y": jnp.arange(7) % 3}
    params, loss_fn, C = setup(model, batch, x, 1)
    per_example = jc.explain(loss_fn, params, batch)[-1]["per_example_bytes"]
    assert jc.explain(loss_fn, params, batch)[-1]["batch_chunk"] == 7        # small state: one pass
    monkeypatch.setattr(engine, "CPU_CHUNK_BYTES", 3 * per_example)
    monkeypatch.setattr(engine, "MIN_CHUNK", 1)
    assert jc.explain(loss_fn, params, batch)[-1]["batch_chunk"] == 2        # 3 -> the power of two below
    ref_sum, ref_norms = reference(loss_fn, params, batch, C)
    for chunk in ("auto", 3, None):
        check(run(loss_fn, params, batch, l2_clip=C, batch_chunk=chunk), ref_sum, ref_norms)
    for bad in (0, -2, 2.5, "all", True):
        with pytest.raises(ValueError, match="batch_chunk"):
            jc.clipped_grad(loss_fn, params, batch, l2_clip=C, batch_chunk=bad)
        with pytest.raises(ValueError, match="batch_chunk"):
            jc.dp_sgd(loss_fn, optax.sgd(0.1), num_examples=7, batch_size=2, l2_clip=C, delta=1e-5, steps=1,
                      noise_multiplier=1.0, batch_chunk=bad)


class TiedTiny(nn.Module):
    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(50, 8)
        return embed.attend(nn.tanh(embed(ids)))[:, -1]     # [B, 50] logits of the last position


@pytest.mark.slow
@CPU_CHUNK_RULE
def test_auto_chunks_keep_instantiated_gradients_in_one_piece():
    """"auto" takes chunks in which every instantiated per-example gradient fits `memory_limit` at once (the
    50 x 8 tied embedding, 1,600 bytes per example: a limit of 3 examples -> chunks of 2), so they are kept
    and weighted for the clipped sum instead of a second product; exact against vmap(grad)."""
    ids = jax.random.randint(jax.random.PRNGKey(0), (7, 6), 0, 50)
    batch = {"x": ids, "y": jnp.arange(7) % 50}
    params, loss_fn, C = setup(TiedTiny(), batch, ids, 1)
    rows = jc.explain(loss_fn, params, batch, memory_limit=3 * 4 * 50 * 8)
    assert rows[-1]["leaves"]["['Embed_0']['embedding']"]["norm"] == "lookup + instantiated"
    assert rows[-1]["batch_chunk"] == 2
    assert jc.explain(loss_fn, params, batch)[-1]["batch_chunk"] == 7        # the default limit: one pass
    ref_sum, ref_norms = reference(loss_fn, params, batch, C)
    for limit in (3 * 4 * 50 * 8, 4 * 50 * 8 - 1):   # kept in chunks of 2; formed one example at a time
        check(run(loss_fn, params, batch, l2_clip=C, memory_limit=limit), ref_sum, ref_norms)


@pytest.mark.slow
def test_long_lookup_norms_sum_repeated_ids_exactly():
    # sort-based norms of a long lookup (T = 300, many repeated ids) equal ||onehot^T R||^2 built densely
    from jdp.clipping.norms import lookup_sq_norms
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 40, size=(3, 300)), jnp.int32)
    R = jnp.asarray(rng.normal(size=(3, 300, 5)), jnp.float32)
    dense = jax.vmap(lambda i, r: jnp.sum(jnp.zeros((40, 5)).at[i].add(r) ** 2))(ids, R)
    np.testing.assert_allclose(np.asarray(lookup_sq_norms(ids, R)[0]), np.asarray(dense), rtol=1e-5)
    short = lookup_sq_norms(ids[:, :4], R[:, :4])[0]  # the dense form below the size threshold
    np.testing.assert_allclose(np.asarray(short), np.asarray(jax.vmap(
        lambda i, r: jnp.sum(jnp.zeros((40, 5)).at[i].add(r) ** 2))(ids[:, :4], R[:, :4])), rtol=1e-5)


class RNNClassifier(nn.Module):
    """Flax's RNN classifier style: Embed + nn.RNN(cell) + Dense on the last state."""
    cell: str = "lstm"
    reverse: bool = False
    hidden: int = 32
    features: int = 16

    @nn.compact
    def __call__(self, ids):
        cell = {"lstm": nn.LSTMCell, "optimized-lstm": nn.OptimizedLSTMCell, "gru": nn.GRUCell,
                "simple": nn.SimpleCell}[self.cell](self.hidden)
        h = nn.RNN(cell, reverse=self.reverse)(nn.Embed(20, self.features)(ids))
        return nn.Dense(3)(h[:, -1])


@pytest.mark.slow
@pytest.mark.parametrize("cell,reverse", [("lstm", False), ("optimized-lstm", False), ("gru", True),
                                          ("simple", False)])
def test_rnn_cell_kernels_are_tapped_inside_the_scan(cell, reverse):
    """The cells' kernels inside nn.RNN's scan (loop invariants read in matrix products, OptimizedLSTMCell's
    packed side by side) are tapped per iteration instead of sent to the vmap fallback; only the biases (read by
    an add) fall back. Exact for every method, and when a kernel is also read outside the scan it falls back
    whole, still exact. (Short sequences, wide cells: tapping records less than the kernels' size; over long
    sequences small cells fall back, see `_scan_leaves_cheaper_whole`.)"""
    model = RNNClassifier(cell, reverse)
    x = jax.random.randint(jax.random.PRNGKey(4), (6, 3), 0, 20)
    batch = {"x": x, "y": jnp.arange(6) % 3}
    params, loss_fn, C = setup(model, batch, x, 2, clip_scale=0.7)
    ref_sum, ref_norms = reference(loss_fn, params, batch, C)
    for method in ("auto", "ghost", "ghost-two-pass", "bk") if cell == "lstm" else ("auto",):
        check(run(loss_fn, params, batch, l2_clip=C, method=method), ref_sum, ref_norms)
    plan = jc.explain(loss_fn, params, batch)[-1]
    (cell_name,) = set(params) - {"Embed_0", "Dense_0"}
    cell_paths = [f"['{cell_name}']" + jax.tree_util.keystr(k)
                  for k, _ in jax.tree_util.tree_flatten_with_path(params[cell_name])[0]]
    tapped = {r["param"] for r in plan["raw_products"] if r.get("scan_length") == 3}
    assert tapped == {p for p in cell_paths if "kernel" in p}
    assert plan["fallback"] == sorted(p for p in cell_paths if "bias" in p)

    def loss_reg(p, b):  # one kernel also read outside the scan: that kernel falls back whole
        k = p[cell_name][sorted(p[cell_name])[0]]["kernel"]
        return loss_fn(p, b) + 0.01 * jnp.sum(k ** 2)
    ref_sum, ref_norms = reference(loss_reg, params, batch, C)
    check(run(loss_reg, params, batch, l2_clip=C), ref_sum, ref_norms)
    assert any("kernel" in p for p in jc.explain(loss_reg, params, batch)[-1]["fallback"])


@pytest.mark.slow
def test_small_rnn_cell_over_a_long_sequence_falls_back_whole():
    model = RNNClassifier("lstm")
    x = jax.random.randint(jax.random.PRNGKey(4), (4, 40), 0, 20)   # 40 steps × (16 + 32) > 16 × 32
    batch = {"x": x, "y": jnp.arange(4) % 3}
    params, loss_fn, C = setup(model, batch, x, 2, clip_scale=0.7)
    plan = jc.explain(loss_fn, params, batch)[-1]
    assert not any(r.get("scan_length") for r in plan["raw_products"])
    assert sum("kernel" in p for p in plan["fallback"]) == 8
    assert all("why" in plan["leaves"][p] for p in plan["fallback"] if "kernel" in p)
    check(run(loss_fn, params, batch, l2_clip=C), *reference(loss_fn, params, batch, C))


def test_the_tap_or_fallback_choice_is_made_per_scan():
    """Hidden 128 / input 64 over 50 steps: each input kernel alone (64×128) is smaller than its records
    (50 × 192), but the cell's kernels together are larger than all its records: the whole cell is tapped
    (measured 2.2× vs mixed 2.8× vs fallback 5.7× non-private)."""
    model = RNNClassifier("lstm", hidden=128, features=64)
    x = jnp.zeros((2, 50), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    plan = jc.explain(xent(model), params, {"x": x, "y": jnp.zeros(2, jnp.int32)})[-1]
    assert sum(r.get("scan_length") == 50 for r in plan["raw_products"]) == 8
    assert not any("kernel" in p for p in plan["fallback"])


def test_packed_cell_kernels_instantiated_from_one_product_are_exact(monkeypatch):
    """OptimizedLSTMCell's gate kernels, packed side by side, tapped in the scan over 6 steps (forced: the size
    rule sends kernels this small to the fallback): the input-side
    kernels are cheap enough to instantiate, so that packed matrix's per-example gradients are formed once and
    sliced per kernel (`factored._raw_contribs`), the hidden-side ones are ghosted per kernel. Exact against
    vmap(grad) for auto and ghost."""
    from jdp.clipping import engine, taps
    monkeypatch.setattr(taps, "_scan_leaves_cheaper_whole", lambda raw, leaves: set())  # tapped, not whole
    products = []
    einsum = engine.jnp.einsum
    monkeypatch.setattr(engine.jnp, "einsum", lambda spec, *a, **k: products.append(spec) or einsum(spec, *a, **k))
    model = RNNClassifier("optimized-lstm")
    x = jax.random.randint(jax.random.PRNGKey(5), (6, 6), 0, 20)
    batch = {"x": x, "y": jnp.arange(6) % 3}
    params, loss_fn, C = setup(model, batch, x, 2, clip_scale=0.7)
    ref_sum, ref_norms = reference(loss_fn, params, batch, C)
    for method in ("auto", "ghost"):
        check(run(loss_fn, params, batch, l2_clip=C, method=method), ref_sum, ref_norms)
    tapped = {r["param"] for r in jc.explain(loss_fn, params, batch)[-1]["raw_products"] if r.get("scan_length") == 6}
    assert len(tapped) == 8 and all("kernel" in p for p in tapped)
    assert "btp,btq->bpq" in products  # the packed product's per-example gradients, formed once


def test_instantiation_chunks_divide_the_batch_when_they_can():
    """Instantiated per-example gradients are formed in chunks under memory_limit: a divisor of the batch when one
    is at least half the limit's count (no padded copy of the factors), else the limit's count."""
    from jdp.clipping.norms import _chunk_size
    per_example = 4 * 20000 * 64                                   # a 20k x 64 embedding gradient
    assert _chunk_size(16, 20000, 64, 6 * per_example) == 4        # limit 6: divisor 4 (6 would pad to 18)
    assert _chunk_size(14, 20000, 64, 6 * per_example) == 6        # limit 6: divisors 1, 2 too small
    assert _chunk_size(16, 20000, 64, 64 * per_example) == 16      # the whole batch fits
    assert _chunk_size(16, 20000, 64, 1) == 1
