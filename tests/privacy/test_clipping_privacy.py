"""Privacy regression tests of `jdp.clipping` (audit items 3 and 9, first half).

Item 3: the engine's per-example norms and clipped sums follow the model's OWN gradient (nn.Embed's id
semantics: -1 wraps to the last row, ids outside [-V, V) read no row, a one-row table broadcasts), and
no example's clipped contribution exceeds the clip bound, for every method.
Item 9: a NaN/inf in a masked-out (padding) example never reaches grad_sum; a non-finite unmasked
example is counted in num_nonfinite and contributes exactly nothing.
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdp.clipping as jc
from jdp.clipping.engine import lookup_rows

V = 11             # vocabulary of the test model
B, T = 8, 5
C = 6.0            # clip bound: about half the examples of the test batch are clipped
REL = 1e-4         # float32 agreement with the vmap(grad) reference
SENS_REL = 1e-5    # float32 rounding allowed on top of the clip bound
GID = jnp.array([0, 0, 1, 2, 2, 2, 1, 3])   # user of each example (user-level clipping)


def _methods(methods=jc.METHODS, slow=("ghost-two-pass", "vmap")):
    """`methods` as parameters, those in `slow` (the non-default two-pass path and the vmap reference, which the
    default suite checks elsewhere) marked for the slow suite: it keeps the default suite within its time."""
    return [pytest.param(m, marks=pytest.mark.slow) if m in slow else m for m in methods]


# ------------------------------------------------------------------------------------------ model
class Model(nn.Module):
    """Tied item embedding (lookup + attend on one table: Phantom clipping), a bag-of-embeddings head,
    a one-row table, a category embedding and a dense feature path.

    Padding -1 is NOT masked: it reaches the loss as row V-1 (nn.Embed's semantics). Item ids outside
    [-V, V) are masked by the model itself (its own padding convention). The one-row table broadcasts
    its row to every id. The category table `s` and the features `x` are not masked at all, so an
    out-of-range category or a NaN feature makes the example's loss non-finite.
    """

    @nn.compact
    def __call__(self, b):
        t = b["t"]
        emb = nn.Embed(V, 6)
        inside = ((t >= -V) & (t < V))[..., None]
        h = jnp.where(inside, emb(t), 0.0) + nn.Embed(1, 6)(t) + nn.Dense(6)(b["x"])[:, None]
        tok_logits = emb.attend(nn.tanh(nn.Dense(6)(h)))                    # [B, T, V]
        bag_logits = nn.Dense(3)(h.mean(1) + nn.Embed(V, 6)(b["s"]))        # [B, 3]
        return tok_logits, bag_logits


def _ce(logits, y):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1)[..., 0]


def loss_fn(p, b):
    tok, bag = Model().apply({"params": p}, b)
    return _ce(tok, b["yt"]).sum(-1) + _ce(bag, b["y"])


def _case(seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    t = rng.integers(-V - 3, V + 3, (B, T))
    t[0] = -1                      # all-padding row that reaches the loss (row V-1, T times)
    t[1] = V + 2                   # all out-of-range: the model masks every position
    t[2, : T // 2] = -1            # half padding
    t[3] = -V                      # wraps to row 0
    batch = {"t": jnp.asarray(t, jnp.int32), "s": jnp.asarray(rng.integers(0, V, B), jnp.int32),
             "x": jnp.asarray(rng.normal(size=(B, 4)), jnp.float32),
             "yt": jnp.asarray(rng.integers(0, V, (B, T))), "y": jnp.asarray(rng.integers(0, 3, B))}
    params = Model().init(jax.random.PRNGKey(seed), jax.tree.map(lambda a: a[:1], batch))["params"]
    return jax.tree.map(lambda a: a * scale, params), batch


def _flat(tree, rows=None):
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]
    return np.concatenate([x.reshape(rows, -1) if rows else x.reshape(-1) for x in leaves], axis=-1)


def _jit(f):
    """jax.jit compiled once, for the first call's shapes, without XLA's backend optimisations: the
    programs are tiny and run a few dozen times, so compilation dominates the test time."""
    compiled = []

    def call(*args):
        if not compiled:
            compiled.append(jax.jit(f).lower(*args).compile({"xla_backend_optimization_level": 0}))
        return compiled[0](*args)
    return call


def _reference_grads(p, b):
    # float32 matmuls like the engine's default (GPUs would use TF32 for the reference otherwise)
    with jax.default_matmul_precision("highest"):
        return jc.per_example_grads_reference(loss_fn, p, b)


_reference = _jit(_reference_grads)


CONFIGS = {"plain": {}, "normalize": {"normalize": True}, "user": {"group_ids": GID, "num_groups": 4},
           "per_layer": {"clip_partition": "per_layer"}}


@functools.lru_cache(maxsize=None)
def _program(method):
    # one program per method for every configuration: they share the per-example pass, so XLA
    # compiles that once (compilation, not running, is what these tests spend their time on)
    def f(p, b, m):
        out = {}
        for name, kw in CONFIGS.items():
            cg = jc.clipped_grad(loss_fn, p, b, l2_clip=C, mask=m, method=method, **kw)
            out[name] = (cg.grad_sum, cg.norms, cg.clip_factors, cg.num_nonfinite)
        return out
    return _jit(f)


def engine(method, config="plain"):
    """clipped_grad(params, batch, mask) of the test model -> (grad_sum, norms, clip_factors, num_nonfinite)."""
    return lambda p, b, m: _program(method)(p, b, m)[config]


ALL = jnp.ones(B, bool)


# ------------------------------------------------------------------------------- item 3: semantics
def test_lookup_rows_is_the_row_nn_embed_reads():
    """Audit item 3: the rows the engine scatters to are exactly those nn.Embed's own gradient reaches
    (negative ids wrap; ids outside [-M, M) read none; a one-row table broadcasts), for several id
    dtypes (with int8 ids and M=300, jnp.take maps -1 to row 43: the engine follows the layer)."""
    for M, dtype, ids in [(5, jnp.int32, [-7, -6, -5, -3, -1, 0, 4, 5, 6, 1 << 30]),
                          (5, jnp.int8, [-128, -6, -5, -1, 0, 4, 5, 127]),
                          (300, jnp.int8, [-128, -1, 0, 127]),
                          (5, jnp.uint8, [0, 4, 5, 255]),
                          (1, jnp.int32, [-9, -1, 0, 3])]:
        ids = jnp.asarray(np.array(ids).astype(np.dtype(dtype)))
        w = jnp.arange(1.0, len(ids) + 1)[:, None]

        def f(e, ids=ids, M=M, w=w):
            out = nn.Embed(M, 1).apply({"params": {"embedding": e}}, ids)
            return jnp.sum(jnp.where(jnp.isfinite(out), out, 0.0) * w)

        want = np.asarray(jax.grad(f)(jnp.zeros((M, 1))))[:, 0]
        rows = np.asarray(lookup_rows(ids, M))
        got = np.zeros(M)
        np.add.at(got, rows[rows >= 0], np.asarray(w)[rows >= 0, 0])
        np.testing.assert_array_equal(got, want, err_msg=f"M={M} dtype={dtype.__name__}")
    assert lookup_rows(jnp.array([-1], jnp.int32), 7).tolist() == [6]


@pytest.mark.parametrize("method", _methods())
def test_norms_and_clipped_sum_follow_the_models_own_gradient(method):
    """Audit item 3: with -1 padding reaching the loss, ids >= vocab and < -vocab masked by the model,
    all-padding rows, a one-row table and tied embeddings, every method's per-example and per-user
    norms and clipped sum equal the jax.vmap(jax.grad) reference (the old engine treated -1 as 'no
    gradient': norms and sums off by up to ~15%)."""
    params, batch = _case()
    per = _flat(_reference(params, batch), B)
    ref = np.linalg.norm(per, axis=1)
    assert 0.2 < np.mean(ref > C) < 0.8           # the bound is active for some examples only
    g, norms, _, bad = engine(method)(params, batch, ALL)
    assert int(bad) == 0
    np.testing.assert_allclose(np.asarray(norms), ref, rtol=REL)
    want = (per * np.minimum(1.0, C / ref)[:, None]).sum(0)
    np.testing.assert_allclose(_flat(g), want, rtol=REL, atol=REL * C)
    # user level: the norm of each user's summed gradient (cross terms between its examples included)
    users = np.stack([per[np.asarray(GID) == n].sum(0) for n in range(4)])
    unorm = np.linalg.norm(users, axis=1)
    g, norms, _, _ = engine(method, "user")(params, batch, ALL)
    np.testing.assert_allclose(np.asarray(norms), unorm, rtol=REL)
    np.testing.assert_allclose(_flat(g), (users * np.minimum(1.0, C / unorm)[:, None]).sum(0),
                               rtol=REL, atol=REL * C)


@pytest.mark.parametrize("method", _methods())
def test_every_contribution_is_within_the_clip_bound(method):
    """Audit item 3 (sensitivity): for random single-example batches (all rows but one masked) and for
    each example's contribution to a multi-example batch (grad_sum with it minus grad_sum without it),
    the clipped contribution never exceeds C, with and without normalize; per user the same holds for
    a user's whole contribution. On the old engine ghost-two-pass exceeded C with -1 padding."""
    eye = jnp.eye(B, dtype=bool)
    for normalize in (False, True):
        step = engine(method, "normalize" if normalize else "plain")
        worst = 0.0
        for seed, scale in ((1, 0.05), (2, 1.0), (3, 4.0)):     # tiny to large gradients
            params, batch = _case(seed, scale)
            full = _flat(step(params, batch, ALL)[0])
            for b in range(B):
                alone = np.linalg.norm(_flat(step(params, batch, eye[b])[0]))
                worst = max(worst, alone, np.linalg.norm(full - _flat(step(params, batch, ~eye[b])[0])))
                if normalize:   # normalised clipping releases exactly C for every example
                    assert alone == pytest.approx(C, rel=1e-3)
        assert worst <= C * (1 + SENS_REL), (normalize, worst / C)
    step = engine(method, "user")
    params, batch = _case(3, 4.0)
    full = _flat(step(params, batch, ALL)[0])
    for n in range(4):
        assert np.linalg.norm(full - _flat(step(params, batch, GID != n)[0])) <= C * (1 + SENS_REL)


def test_per_layer_clipping_sensitivity():
    """Audit item 3 (sensitivity): per-layer clipping stays within its documented sensitivity
    sqrt(sum_k C_k^2) = C, book-keeping and two-pass alike."""
    eye = jnp.eye(B, dtype=bool)
    params, batch = _case(2, 4.0)
    for method in jc.METHODS:
        step = engine(method, "per_layer")
        for b in range(B):
            assert np.linalg.norm(_flat(step(params, batch, eye[b])[0])) <= C * (1 + SENS_REL)


# ----------------------------------------------------------------------------------- item 9: NaN
def _poison(batch, rows, kind):
    rows = np.asarray(rows)
    if kind == "nan-x":
        return {**batch, "x": batch["x"].at[rows, 1].set(jnp.nan)}
    if kind == "inf-x":
        return {**batch, "x": batch["x"].at[rows].set(jnp.inf)}
    return {**batch, "s": batch["s"].at[rows].set(V + 5)}   # out-of-range id: nn.Embed returns NaN


KINDS = ("nan-x", "inf-x", "oob-id")


@pytest.mark.parametrize("method", jc.METHODS)
def test_nan_in_padding_rows_never_reaches_grad_sum(method):
    """Audit item 9: NaN / inf inputs (and out-of-range ids, which nn.Embed turns into NaN) in masked-out
    rows leave grad_sum exactly as with clean padding and num_nonfinite == 0, per example and per user
    (the old engine returned a NaN grad_sum with num_nonfinite 0, and per user flagged every unit)."""
    params, batch = _case()
    mask = jnp.array([1, 1, 1, 0, 1, 1, 1, 0], bool)
    for grouped in (False, True):
        step = engine(method, "user" if grouped else "plain")
        clean = step(params, batch, mask)
        assert int(clean[3]) == 0
        for kind in KINDS:
            g, norms, _, bad = step(params, _poison(batch, [3, 7], kind), mask)
            assert int(bad) == 0, (kind, grouped)
            # (ghost-two-pass then sums by book-keeping: equal up to float rounding)
            np.testing.assert_allclose(_flat(g), _flat(clean[0]), rtol=1e-5, atol=1e-6, err_msg=kind)
            if not grouped:
                assert float(norms[3]) == 0.0 and float(norms[7]) == 0.0


@pytest.mark.parametrize("method", jc.METHODS)
def test_nonfinite_unmasked_example_is_counted_and_contributes_nothing(method):
    """Audit item 9: an unmasked example whose loss or gradient is not finite is counted in
    num_nonfinite, gets factor 0 and norm inf, and grad_sum equals the result without it (never NaN,
    never above the sensitivity); per user its whole unit is dropped, other users are unaffected.
    (Called eagerly, clipped_grad raises a ValueError instead: tests/clipping/test_engine.py.)"""
    params, batch = _case()
    for kind in KINDS:
        bad_batch = _poison(batch, [4], kind)
        g, norms, fac, bad = engine(method)(params, bad_batch, ALL)
        want = engine(method)(params, bad_batch, jnp.arange(B) != 4)[0]
        assert int(bad) == 1 and float(fac[4]) == 0.0 and np.isinf(float(norms[4])), kind
        np.testing.assert_allclose(_flat(g), _flat(want), rtol=1e-5, atol=1e-6, err_msg=kind)
        # per user: user 2 holds examples 3, 4 and 5; it is dropped as a whole
        g, norms, fac, bad = engine(method, "user")(params, bad_batch, ALL)
        want = engine(method, "user")(params, bad_batch, GID != 2)[0]
        assert int(bad) == 1 and float(fac[2]) == 0.0 and np.all(np.asarray(fac)[[0, 1, 3]] > 0), kind
        np.testing.assert_allclose(_flat(g), _flat(want), rtol=1e-5, atol=1e-6, err_msg=kind)


def gated_loss(p, b):
    """loss_fn plus sqrt(|g · mean logit|): with g = 0 the loss is finite (0 added) and every gradient of the
    example is NaN (sqrt's derivative at 0 times 0), so only its factors, not its loss, are non-finite."""
    tok, bag = Model().apply({"params": p}, b)
    return _ce(tok, b["yt"]).sum(-1) + _ce(bag, b["y"]) + jnp.sqrt(jnp.abs(b["g"] * tok.mean(axis=(1, 2))))


@functools.lru_cache(maxsize=None)
def _gated_program(method):
    def f(p, b, m):
        return [jc.clipped_grad(gated_loss, p, b, l2_clip=C, mask=m, method=method, **kw)
                for kw in (CONFIGS["plain"], CONFIGS["user"])]
    return _jit(f)


@pytest.mark.parametrize("method", _methods())
def test_a_finite_loss_with_a_nonfinite_gradient_is_dropped_and_never_poisons_the_sum(method):
    """The worst case of the finiteness check: an example whose loss is finite but whose every gradient factor
    (logit gradients of the tied embedding, lookup rows, Dense factors) is NaN, so only its factors can tell.
    Masked out (rows 3 and 7), grad_sum is the clean one and nothing is counted; unmasked (row 4), it is
    counted, gets factor 0 and norm inf, and grad_sum equals the run that masks it out (per user: its user 2
    is dropped as a whole)."""
    params, batch = _case()
    ones = jnp.ones(B, jnp.float32)
    clean = {**batch, "g": ones}
    prog = _gated_program(method)
    ref_plain, _ = prog(params, clean, ALL)
    assert np.all(np.isfinite(_flat(ref_plain.grad_sum))) and int(ref_plain.num_nonfinite) == 0
    mask = jnp.array([1, 1, 1, 0, 1, 1, 1, 0], bool)
    masked_clean = prog(params, clean, mask)
    got = prog(params, {**batch, "g": ones.at[jnp.array([3, 7])].set(0.0)}, mask)
    for r, want in zip(got, masked_clean):
        assert int(r.num_nonfinite) == 0
        np.testing.assert_allclose(_flat(r.grad_sum), _flat(want.grad_sum), rtol=1e-5, atol=1e-6)
    gated = {**batch, "g": ones.at[4].set(0.0)}
    assert np.all(np.isfinite(np.asarray(gated_loss(params, gated))))   # the loss alone would not flag it
    plain, user = prog(params, gated, ALL)
    assert int(plain.num_nonfinite) == 1 and float(plain.clip_factors[4]) == 0.0 and np.isinf(float(plain.norms[4]))
    np.testing.assert_allclose(_flat(plain.grad_sum), _flat(prog(params, clean, jnp.arange(B) != 4)[0].grad_sum),
                               rtol=1e-5, atol=1e-6)
    assert int(user.num_nonfinite) == 1 and float(user.clip_factors[2]) == 0.0
    assert np.all(np.asarray(user.clip_factors)[[0, 1, 3]] > 0)
    np.testing.assert_allclose(_flat(user.grad_sum), _flat(prog(params, clean, GID != 2)[1].grad_sum),
                               rtol=1e-5, atol=1e-6)


class ZeroPartner(nn.Module):
    """A Dense layer whose output at the positions `keep` hides is replaced by 0 before the loss: there its
    output gradient is exactly 0, so a NaN or inf input there leaves the loss finite and meets only zeros in
    every product the norms take (the gradient itself is NaN: NaN * 0)."""
    width: int

    @nn.compact
    def __call__(self, b):
        h = nn.Dense(self.width)(b["x"])
        h = jnp.where(b["keep"][..., None], h, 0.0)
        return jnp.sum(jnp.tanh(h) ** 2, axis=(-2, -1))


@pytest.mark.parametrize("method,width,positions", [("auto", 3, 4), ("auto", 64, 2), ("ghost", 3, 4)])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_nonfinite_factor_that_meets_only_zeros_is_still_dropped(method, width, positions, value):
    """The worst case for norms taken from the factors as recorded (`engine._clip_batch` skips the zeroing
    when every norm is finite): example 2's input is non-finite only at a position whose output gradient is
    exactly 0, in a layer whose norm is instantiated (width 3) or ghosted (width 64, or method ghost), compiled
    at XLA's default optimisation level as users run it. It must be counted and contribute nothing, whole
    and in chunks, and grad_sum must equal the run that masks it out."""
    model = ZeroPartner(width)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, positions, width)).astype(np.float32)
    keep = np.ones((B, positions), bool)
    keep[2, 1] = False
    batch = {"x": jnp.asarray(x), "keep": jnp.asarray(keep)}
    params = model.init(jax.random.PRNGKey(0), jax.tree.map(lambda a: a[:1], batch))["params"]

    def loss(p, b):
        return model.apply({"params": p}, b)

    poisoned = {**batch, "x": batch["x"].at[2, 1].set(value)}
    assert np.all(np.isfinite(np.asarray(loss(params, poisoned))))
    run = jax.jit(lambda p, b, m, k: jc.clipped_grad(loss, p, b, l2_clip=0.5, mask=m, method=method,
                                                     batch_chunk=k), static_argnums=3)
    want = run(params, batch, jnp.arange(B) != 2, None)
    for k in (None, 3):
        got = run(params, poisoned, ALL, k)
        assert int(got.num_nonfinite) == 1 and float(got.clip_factors[2]) == 0.0 and np.isinf(float(got.norms[2]))
        np.testing.assert_allclose(_flat(got.grad_sum), _flat(want.grad_sum), rtol=1e-5, atol=1e-7)
        masked = run(params, poisoned, jnp.arange(B) != 2, k)   # masked out: nothing counted, the same sum
        assert int(masked.num_nonfinite) == 0
        np.testing.assert_allclose(_flat(masked.grad_sum), _flat(want.grad_sum), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method", _methods(["auto", "ghost-two-pass", "vmap"]))
def test_a_batch_run_in_chunks_equals_the_whole_batch_and_its_padding_adds_nothing(method):
    """batch_chunk=3 on B = 8 runs three chunks of 3, the last one padded with a repeat of example 7 that is
    masked out: every output equals the whole batch's (a repeat that counted would add up to one more clip
    bound), also with NaN rows masked out (rows 3 and 7: the padding repeats a NaN row) and with an unmasked
    non-finite example (counted once, contributing nothing)."""
    params, batch = _case()
    prog = _jit(lambda p, b, m: [jc.clipped_grad(loss_fn, p, b, l2_clip=C, mask=m, method=method, batch_chunk=k)
                                 for k in (None, 3)])
    mask = jnp.array([1, 1, 1, 0, 1, 1, 1, 0], bool)
    for b, m, bad in [(batch, ALL, 0), (_poison(batch, [3, 7], "nan-x"), mask, 0),
                      (_poison(batch, [4], "inf-x"), ALL, 1)]:
        whole, chunked = prog(params, b, m)
        assert int(chunked.num_nonfinite) == int(whole.num_nonfinite) == bad
        np.testing.assert_allclose(_flat(chunked.grad_sum), _flat(whole.grad_sum), rtol=1e-5, atol=1e-6)
        for name in ("norms", "clip_factors", "loss"):
            np.testing.assert_allclose(np.asarray(getattr(chunked, name)), np.asarray(getattr(whole, name)),
                                       rtol=1e-5, err_msg=name)


def test_a_dropped_examples_overflowing_kept_gradient_never_reaches_the_clipped_sum():
    """Per-example gradients instantiated in one piece are kept and weighted for the clipped sum
    (`norms.LeafContribs.dense`). Example 1's factors are finite but their product overflows float32, so its
    norm is inf and its weight 0: its kept gradient must be dropped with `where` (0 * inf would be NaN and
    would poison the release), and the sum must equal the one from the factors."""
    from jdp.clipping import norms
    rng = np.random.default_rng(0)
    L = jnp.asarray(rng.normal(size=(3, 8, 2)), jnp.float32).at[1].multiply(1e30)
    R = jnp.asarray(rng.normal(size=(3, 8, 3)), jnp.float32).at[1].multiply(1e10)
    c = norms.LeafContribs((2, 3), pq=(2, 3), mats=[(L, R)])
    assert norms.choose_instantiate(c, "auto")
    sq = norms.sq_norms_diag(c, "auto", 1 << 20)[0]
    assert c.dense is not None and not bool(jnp.isfinite(sq[1])) and bool(jnp.isfinite(sq[0])) and bool(jnp.isfinite(sq[2]))
    assert not bool(jnp.all(jnp.isfinite(c.dense[1])))       # the overflow the weight must not touch
    w = jnp.array([0.5, 0.0, 0.25])
    with jax.default_matmul_precision("highest"):                # as `clipped_grad` traces it (GPUs: not TF32)
        got = norms.clipped_sum(c, w)
        want = norms.clipped_sum(norms.LeafContribs((2, 3), pq=(2, 3), mats=[(L, R)]), w)  # from the factors
    assert bool(jnp.all(jnp.isfinite(got)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)


def test_mask_must_be_an_indicator():
    """Audit item 9: the mask selects examples, it never weights them (a weight of 2 would double an
    example's clipped contribution beyond the sensitivity)."""
    params, batch = _case()
    with pytest.raises(ValueError, match="mask"):
        jc.clipped_grad(loss_fn, params, batch, l2_clip=C, mask=jnp.array([1, 2, 1, 0, 1, 1, 1, 1.0]))


def test_dp_sgd_step_and_vmap_fallback_ignore_nan_padding():
    """Audit item 9: DP-SGD's step (metrics included) and the engine's vmap reference (the per-example path
    seq-rec once had its own copy of) are unaffected by a NaN in a padding row; a non-finite unmasked
    example is counted and dropped."""
    params, batch = _case()
    mask = jnp.array([1, 1, 1, 0, 1, 1, 1, 0], bool)
    dirty = _poison(batch, [3, 7], "nan-x")
    dp = jc.dp_sgd(loss_fn, optax.sgd(0.1), num_examples=B, batch_size=4, l2_clip=C, delta=1e-5,
                   steps=1, noise_multiplier=1.0, max_batch_size=B)
    outs = []
    for b in (batch, dirty):
        state, metrics = dp.step(dp.init(params, jax.random.PRNGKey(7)), b, mask)
        outs.append((_flat(state.params), metrics))
    np.testing.assert_allclose(outs[1][0], outs[0][0], rtol=1e-6)
    assert int(outs[1][1]["num_nonfinite"]) == 0
    assert float(outs[1][1]["loss"]) == pytest.approx(float(outs[0][1]["loss"]), rel=1e-6)

    fb = _jit(lambda p, b, m: jc.clipped_grad(loss_fn, p, b, l2_clip=C, mask=m, method="vmap"))
    clean, res = fb(params, batch, mask), fb(params, dirty, mask)
    np.testing.assert_allclose(_flat(res.grad_sum), _flat(clean.grad_sum), rtol=1e-6, atol=1e-9)
    assert int(res.num_nonfinite) == 0 and float(res.norms[3]) == 0.0
    res = fb(params, _poison(batch, [4], "inf-x"), ALL)
    want = fb(params, _poison(batch, [4], "inf-x"), jnp.arange(B) != 4)
    assert int(res.num_nonfinite) == 1
    np.testing.assert_allclose(_flat(res.grad_sum), _flat(want.grad_sum), rtol=1e-6, atol=1e-9)


@pytest.mark.slow
def test_chunked_accumulate_adds_at_most_one_clip_bound_per_added_unit():
    """DPSGD.accumulate over a sample laid out in chunks of different shapes (as jdp.seqrec does): adding
    the worst neighbour (a unit with a huge gradient, in a chunk of its own shape, padding rows beside it)
    moves the accumulated sum by at most C, and by exactly C when it is clipped; masked padding rows and
    the chunk layout change nothing."""
    params, batch = _case(scale=3.0)
    dp = jc.dp_sgd(loss_fn, optax.sgd(0.1), num_examples=B, batch_size=4, l2_clip=C, delta=1e-5, steps=1,
                   noise_multiplier=1.0)
    take = lambda rows: jax.tree.map(lambda a: a[np.asarray(rows)], batch)  # noqa: E731
    zero = jax.tree.map(jnp.zeros_like, params)

    def layout(chunks):
        acc = zero
        for rows, mask in chunks:
            acc, _ = dp.accumulate(params, acc, take(rows), jnp.asarray(mask))
        return _flat(acc)

    base = layout([([4, 5, 6], [1, 1, 1]), ([3, 3], [1, 0])])
    same = layout([([4, 5], [1, 1]), ([6, 3, 3, 3], [1, 1, 0, 0])])     # other chunk shapes, more padding
    np.testing.assert_allclose(same, base, rtol=1e-5, atol=1e-5)
    worst = layout([([4, 5, 6], [1, 1, 1]), ([3, 7], [1, 1])])         # neighbour: unit 7 added
    norm7 = float(jc.clipped_grad(loss_fn, params, take([7]), l2_clip=C).norms[0])
    assert norm7 > C  # the added unit is clipped: the bound is attained
    assert np.linalg.norm(worst - base) == pytest.approx(C, rel=SENS_REL * 10)


# ------------------------------------------------------------------------------------------ shared leaves
@pytest.mark.parametrize("method", _methods(["auto", "ghost", "ghost-two-pass"]))
def test_a_leaf_shared_with_an_untapped_layer_is_differentiated_at_every_use(method):
    """Regression: two nnx layers share one kernel and the second layer's bias is also read outside it (a
    penalty), so the second layer cannot be tapped. Before the fix the shared kernel still counted as covered
    by the first layer's taps and the second layer's use of it was never differentiated: per-example norms
    came out too small (5.36 instead of 6.06 for one example) and clipped examples could exceed C. Now every
    leaf of an untapped layer falls back whole; norms equal vmap(grad)'s and each contribution is ≤ C."""
    from flax import nnx

    class Shared(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(4, 4, rngs=rngs)
            self.b = nnx.Linear(4, 4, rngs=rngs)
            self.b.kernel = self.a.kernel      # one kernel, two layers

        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x)))

    graphdef, params = nnx.split(Shared(nnx.Rngs(0)), nnx.Param)

    def loss_fn(p, b):
        out = nnx.merge(graphdef, p)(b["x"])
        return jnp.sum(out ** 2, -1) + jnp.sum(p["b"]["bias"][...] ** 2) * jnp.sum(b["x"], -1)

    batch = {"x": jax.random.normal(jax.random.PRNGKey(1), (B, 4))}
    per = jc.per_example_grads_reference(loss_fn, params, batch)
    norms = np.sqrt(sum((np.asarray(g, np.float64).reshape(B, -1) ** 2).sum(1) for g in jax.tree.leaves(per)))
    clip = float(np.median(norms))
    cg = jc.clipped_grad(loss_fn, params, batch, l2_clip=clip, method=method)
    np.testing.assert_allclose(np.asarray(cg.norms), norms, rtol=REL)
    for b in range(B):
        one = jc.clipped_grad(loss_fn, params, jax.tree.map(lambda v: v[b:b + 1], batch), l2_clip=clip, method=method)
        total = np.sqrt(sum(float(jnp.sum(jnp.asarray(g, jnp.float32) ** 2)) for g in jax.tree.leaves(one.grad_sum)))
        assert total <= clip * (1 + SENS_REL)


# ---------------------------------------------------------------- item 9 for convolutions (lazy patches)
CONV_KERNEL_GRADS = __import__("jdp.clipping.taps", fromlist=["taps"]).conv_kernel_grads


class ConvNet(nn.Module):
    """Strided VALID conv (leaves the last input row and column unread), then a SAME conv. groups = 2: the
    first conv is grouped, whose per-example gradients come from the layer's transposed convolution."""
    groups: int = 1

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Conv(4, (3, 3), strides=(2, 2), padding="VALID", feature_group_count=self.groups)(x))
        h = nn.Conv(3, (2, 2), padding="SAME")(h)
        return jnp.sum(h.mean((1, 2)) ** 2, -1)


@pytest.mark.slow
@pytest.mark.parametrize("method,groups,size", [("auto", 1, 8), ("auto", 2, 8), ("auto", 1, 34), ("ghost", 1, 8),
                                               ("vmap", 1, 8)])
def test_conv_examples_with_nonfinite_inputs_are_dropped_exactly_where_the_layer_reads_them(method, groups, size,
                                                                                            monkeypatch):
    """Convolutions check finiteness on the layer input and zero dropped examples there (the im2col patches
    are rebuilt from it): a NaN a conv reads drops the example (counted, contributes nothing, grad_sum equals
    the run without it); in a masked-out row it changes nothing; a NaN in an input position no output reads
    (strided VALID crop) leaves the example's gradient finite, so it is kept, as by the vmap reference.
    size 34: 16 x 16 outputs, where the first conv runs as one transposed convolution over the whole batch
    (`taps.conv_kernel_grads`): no value of one example may reach another's gradient, not even a huge one."""
    from jdp.clipping import taps
    calls = []
    monkeypatch.setattr(taps, "conv_kernel_grads", lambda *a: calls.append(1) or CONV_KERNEL_GRADS(*a))
    model = ConvNet(groups)
    x = jax.random.normal(jax.random.key(0), (6, size, size, 2))
    params = model.init(jax.random.key(1), x[:1])

    def loss_fn(p, b):
        return model.apply(p, b)

    step = jax.jit(lambda p, b, m: jc.clipped_grad(loss_fn, p, b, l2_clip=0.5, mask=m, method=method))

    def run(xb, mask):
        r = step(params, xb, mask)
        return _flat(r.grad_sum), int(r.num_nonfinite), np.asarray(r.clip_factors)

    all6, no2 = jnp.ones(6, bool), jnp.arange(6) != 2
    clean = run(x, all6)
    read = x.at[2, 3, 3, 0].set(jnp.nan)                   # read by the first conv
    g, bad, fac = run(read, all6)
    assert bad == 1 and fac[2] == 0.0
    np.testing.assert_allclose(g, run(read, no2)[0], rtol=1e-5, atol=1e-6)
    assert np.all(np.isfinite(g))
    g, bad, _ = run(read, no2)                              # masked out: as with a clean row
    assert bad == 0
    np.testing.assert_allclose(g, run(x, no2)[0], rtol=1e-5, atol=1e-6)
    unread = x.at[2, size - 1, size - 1, :].set(jnp.nan)    # last row/column: no 3x3 stride-2 VALID window reads it
    g, bad, fac = run(unread, all6)
    assert bad == 0 and fac[2] > 0
    np.testing.assert_allclose(g, clean[0], rtol=1e-5, atol=1e-6)
    huge = x.at[2].multiply(1e36)                          # finite, overflowing in its own products only
    g, bad, fac = run(huge, all6)
    g_without = run(huge, no2)[0]
    np.testing.assert_allclose(g - (0.0 if bad else _flat(jc.clipped_grad(  # the others: exactly as without it
        loss_fn, params, huge[2:3], l2_clip=0.5, method=method).grad_sum)), g_without, rtol=1e-4, atol=1e-5)
    assert (len(calls) > 0) == (size > 8 and method == "auto")  # the transposed path ran where it should
