"""Sequential recommenders in Flax linen: Transformer (tied/untied, optional Re-Attention), GRU, LSTM.

Inputs are left-padded item sequences [B, L] (0 = padding, items 1..M). Every model returns hidden
states [B, L, d]; `loss` is the causal next-item cross-entropy at every non-padding position with a
full softmax over all M items (padding id excluded), averaged per sequence -> [B]; `scores` gives
full-catalogue logits [B, M+1] at the last position for ranking (column 0 = -inf).

Layers are standard linen modules (nn.Embed with `attend` for the tied output, nn.Dense projections,
nn.LayerNorm, nn.RNN over nn.GRUCell / nn.OptimizedLSTMCell) so fast per-example clipping applies.
Attention is written from nn.Dense projections because Re-Attention changes its logits.

Re-Attention inputs (`reatt`): a dict {"w_var": scalar, "emb_var": [M+1]} of squared effective errors
(see `reattention.effective_variances`); None or all zeros gives the vanilla Transformer exactly.
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jdp.seqrec import reattention as ra

NEG = -1e9


class SelfAttention(nn.Module):
    """Causal multi-head self-attention from Dense projections, with optional Re-Attention."""
    d: int
    heads: int
    dropout: float

    @nn.compact
    def __call__(self, x, var_x, valid, deterministic: bool, w_var):
        B, L, _ = x.shape
        dh = self.d // self.heads
        proj = {n: nn.Dense(self.d, name=n) for n in ("query", "key", "value")}
        q, k, v = (proj[n](x).reshape(B, L, self.heads, dh) for n in ("query", "key", "value"))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
        if var_x is not None:  # Re-Attention: subtract the variance-induced bias of each key
            var_k = ra.linear_var(x, var_x, proj["key"].variables["params"]["kernel"], w_var)
            corr = ra.attention_logit_correction(q, var_k.reshape(B, L, self.heads, dh))
            logits = logits - jax.lax.stop_gradient(corr)
        causal = jnp.tril(jnp.ones((L, L), bool))
        allowed = causal[None, None] & valid[:, None, None, :]
        allowed = allowed | jnp.eye(L, dtype=bool)[None, None]  # padding queries attend to themselves
        logits = jnp.where(allowed, logits, NEG)
        attn = jax.nn.softmax(logits, axis=-1)
        self.sow("intermediates", "attention", attn)
        attn_d = nn.Dropout(self.dropout)(attn, deterministic=deterministic)
        o = jnp.einsum("bhqk,bkhd->bqhd", attn_d, v).reshape(B, L, self.d)
        out_proj = nn.Dense(self.d, name="out")
        y = out_proj(o)
        var_y = None
        if var_x is not None:
            var_v = ra.linear_var(x, var_x, proj["value"].variables["params"]["kernel"], w_var)
            var_o = jnp.einsum("bhqk,bkhd->bqhd", attn * attn, var_v.reshape(B, L, self.heads, dh))
            var_y = ra.linear_var(o, var_o.reshape(B, L, self.d), out_proj.variables["params"]["kernel"], w_var)
        return y, var_y


class Block(nn.Module):
    """Transformer block. norm="pre" (SASRec, the default): x + Attn(LN(x)), then x + FFN(LN(x));
    norm="post" (Vaswani et al.'s encoder): LN(x + Attn(x)), then LN(x + FFN(x)). FFN: d -> ffn_dim -> d."""
    d: int
    heads: int
    dropout: float
    activation: str = "relu"
    norm: str = "pre"
    ffn_dim: int | None = None

    @nn.compact
    def __call__(self, x, var_x, valid, deterministic: bool, w_var):
        track = var_x is not None
        pre_ln = self.norm == "pre"
        ln1, ln2 = nn.LayerNorm(epsilon=1e-6, name="ln1"), nn.LayerNorm(epsilon=1e-6, name="ln2")

        def norm(ln, z, var_z):  # LayerNorm and its variance rule
            return ln(z), (ra.layernorm_var(z, var_z, ln.variables["params"]["scale"], w_var) if track else None)

        # attention sub-layer
        h, var_h = norm(ln1, x, var_x) if pre_ln else (x, var_x)
        a, var_a = SelfAttention(self.d, self.heads, self.dropout, name="attn")(h, var_h, valid, deterministic, w_var)
        x = x + nn.Dropout(self.dropout)(a, deterministic=deterministic)
        var_x = var_x + var_a if track else None
        if not pre_ln:
            x, var_x = norm(ln1, x, var_x)
        # feed-forward sub-layer
        h, var_h = norm(ln2, x, var_x) if pre_ln else (x, var_x)
        fc1, fc2 = nn.Dense(self.ffn_dim or self.d, name="fc1"), nn.Dense(self.d, name="fc2")
        pre = fc1(h)
        act = jax.nn.relu if self.activation == "relu" else (lambda z: jax.nn.gelu(z, approximate=False))
        f = fc2(nn.Dropout(self.dropout)(act(pre), deterministic=deterministic))
        if track:
            var_pre = ra.linear_var(h, var_h, fc1.variables["params"]["kernel"], w_var)
            _, var_z = ra.activation_moments(self.activation, pre, var_pre)
            var_x = var_x + ra.linear_var(act(pre), var_z, fc2.variables["params"]["kernel"], w_var)
        x = x + nn.Dropout(self.dropout)(f, deterministic=deterministic)
        if not pre_ln:
            x, var_x = norm(ln2, x, var_x)
        x = x * valid[..., None]
        return x, (var_x * valid[..., None] if track else None)


class SeqRecModel(nn.Module):
    """Base fields: catalogue size, width, dropout, tied (embed.attend) or untied (Dense) output."""
    n_items: int
    d: int = 64
    dropout: float = 0.2
    tied: bool = True


def _output(model: SeqRecModel, h: jax.Array, embed: nn.Embed, targets: jax.Array | None = None,
            negatives: jax.Array | None = None) -> jax.Array:
    """Full-catalogue logits [B, L, M+1] with the padding column set to NEG; or, with `negatives` [B, K]
    (sampled softmax), the logits of [target, negative_1..K] at every position [B, L, 1+K] through two
    lookups of the tied table (call inside a compact method)."""
    if negatives is None:
        logits = embed.attend(h) if model.tied else nn.Dense(model.n_items + 1, name="output")(h)
        # a select, not `.at[..., 0].set`: its gradient is elementwise and fuses into the softmax's backward,
        # where the set's (a dynamic-update-slice) made XLA copy the [rows, M+1] logit gradients for each reader
        return jnp.where(jnp.arange(logits.shape[-1]) == 0, NEG, logits)
    if not model.tied:
        raise ValueError("sampled softmax needs the tied output embedding (model 'transformer-untied' has none)")
    pos = jnp.sum(h * embed(targets), axis=-1, keepdims=True)
    neg = jnp.einsum("bld,bkd->blk", h, embed(negatives))
    return jnp.concatenate([pos, neg], axis=-1)


class TransformerRec(SeqRecModel):
    """Transformer over item sequences with learned positions. norm="pre" (default): SASRec's pre-LN
    blocks and a final LayerNorm; norm="post": Vaswani et al.'s post-LN encoder (no final LayerNorm).
    ffn_dim: the feed-forward width (None = d, SASRec's; Vaswani's ratio is 4d).

    reattention=True enables the logit correction in every attention layer (needs `reatt` values)."""
    heads: int = 1
    blocks: int = 2
    maxlen: int = 50
    activation: str = "relu"
    reattention: bool = False
    norm: str = "pre"
    ffn_dim: int | None = None
    item_dim: int | None = None  # None: the item table is [M+1, d]; r < d: [M+1, r] with learned projections r→d
                                 # (inputs) and d→r (before the output: the tied table, or transformer-untied's
                                 # r-wide output layer): DP noise on r, not d, coordinates per item row
    prior: bool = False          # add `transition_prior` (inputs reatt["prior_slot"], reatt["prior_table"]) to the
                                 # full-catalogue logits, times a learned scale (a Dense(1) site, "prior_scale")

    @nn.compact
    def __call__(self, seq: jax.Array, deterministic: bool = True, reatt: dict | None = None,
                 last_only: bool = False, targets: jax.Array | None = None,
                 negatives: jax.Array | None = None) -> jax.Array:
        B, L = seq.shape
        valid = seq > 0
        factored = self.item_dim is not None and self.item_dim != self.d
        embed = nn.Embed(self.n_items + 1, self.item_dim if factored else self.d, name="item_embed")
        pos = nn.Embed(self.maxlen, self.d, name="pos_embed")
        scale = math.sqrt(self.d)
        rows = embed(seq)
        if factored:  # the narrow table's rows widened to d (and h narrowed back to r before the output layer)
            rows = nn.Dense(self.d, use_bias=False, name="item_in")(rows)
        # positions counted from the right end (left padding): a shorter window gives the same outputs
        x = (rows * scale + pos(jnp.arange(L) + (self.maxlen - L))[None]) * valid[..., None]
        track = self.reattention and reatt is not None
        var_x, w_var = None, 0.0
        if track:
            w_var = jnp.asarray(reatt["w_var"], jnp.float32)
            ev = jnp.asarray(reatt["emb_var"], jnp.float32)[seq] * scale * scale + w_var
            var_x = jnp.broadcast_to(ev[..., None], x.shape) * valid[..., None]
        x = nn.Dropout(self.dropout)(x, deterministic=deterministic)
        for b in range(self.blocks):
            x, var_x = Block(self.d, self.heads, self.dropout, self.activation, self.norm, self.ffn_dim,
                             name=f"block{b}")(x, var_x, valid, deterministic, w_var)
        h = nn.LayerNorm(epsilon=1e-6, name="ln_f")(x) if self.norm == "pre" else x
        if last_only:
            h = h[:, -1:]
        if factored:
            h = nn.Dense(self.item_dim, use_bias=False, name="item_out")(h)
        logits = _output(self, h, embed, targets, negatives)
        if not self.prior or negatives is not None:
            return logits
        if reatt is not None and "prior_table" in reatt:
            prior = transition_prior(seq, reatt["prior_slot"], reatt["prior_table"], PRIOR_HISTORY, last_only)
        elif self.is_initializing():  # model.init without the release: the same parameters
            prior = jnp.zeros(logits.shape, logits.dtype)
        else:  # refused, not silently scored without the prior it was trained with
            raise ValueError("this model adds the transition prior: pass reatt with 'prior_slot' and 'prior_table' "
                             "(jdp.seqrec.transitions.TransitionModel.prior_inputs())")
        scaled = nn.Dense(1, use_bias=False, kernel_init=nn.initializers.ones, name="prior_scale")(prior[..., None])
        return logits + scaled[..., 0]


# the items before a position whose release rows score it (`transitions.TransitionModel.history`'s default)
PRIOR_HISTORY = 3


def transition_prior(seq: jax.Array, slot: jax.Array, table: jax.Array, history: int = PRIOR_HISTORY,
                     last_only: bool = False) -> jax.Array:
    """[B, L, M+1] (or [B, 1, M+1] for `last_only`) log(1 + max(s, 0)) of the released transition scores s at each
    position: the sum of the `table` rows [K+1, M+1] of the candidates among the position's last `history` items
    (`slot` [M+1] maps an item id to its candidate row, K for any other item and for padding: a zero row). The
    table is the release's [K, K] sums divided by its noise std and spread over the catalogue's columns
    (`transitions.TransitionModel.prior_inputs`): post-processing of the release, a constant of the step."""
    s = slot[seq]
    if last_only:
        s = s[:, -history:]
    zero_row = table.shape[0] - 1
    total = 0.0
    for lag in range(history):
        shifted = jnp.pad(s, ((0, 0), (lag, 0)), constant_values=zero_row)[:, :s.shape[1]]
        total = total + table[shifted if not last_only else shifted[:, -1:]]
    return jnp.log1p(jnp.maximum(total, 0.0))


class RNNRec(SeqRecModel):
    """GRU or LSTM over the (left-padded) sequence with a tied item embedding."""
    cell: str = "gru"
    maxlen: int = 50

    @nn.compact
    def __call__(self, seq: jax.Array, deterministic: bool = True, reatt: dict | None = None,
                 last_only: bool = False, targets: jax.Array | None = None,
                 negatives: jax.Array | None = None) -> jax.Array:
        valid = seq > 0
        embed = nn.Embed(self.n_items + 1, self.d, name="item_embed")
        x = embed(seq) * valid[..., None]
        x = nn.Dropout(self.dropout)(x, deterministic=deterministic)
        cell = nn.GRUCell(self.d, name="gru") if self.cell == "gru" else nn.OptimizedLSTMCell(self.d, name="lstm")
        h = nn.RNN(cell, name="rnn")(x)
        h = nn.Dropout(self.dropout)(h, deterministic=deterministic)
        if last_only:
            h = h[:, -1:]
        return _output(self, h, embed, targets, negatives)


MODELS = ("dpformer", "transformer", "transformer-untied", "gru", "lstm")


def check_item_dim(name: str, item_dim: int, d: int) -> None:
    """A factorised item table (width r = item_dim ≤ d) is for the Transformers without Re-Attention: DPFormer's
    effective-variance rule describes rows of a d-wide table."""
    if name not in ("transformer", "transformer-untied"):
        raise ValueError(f"item_dim (a factorised item table) is for the models 'transformer' and "
                         f"'transformer-untied', got {name!r}")
    if not 1 <= int(item_dim) <= d:
        raise ValueError(f"item_dim must be in [1, d={d}], got {item_dim}")


NORMS = ("pre", "post")


def make_model(name: str, n_items: int, maxlen: int, d: int = 64, heads: int = 1, blocks: int = 2,
               dropout: float = 0.2, activation: str = "relu", norm: str = "pre",
               ffn_dim: int | None = None, item_dim: int | None = None, prior: bool = False) -> SeqRecModel:
    """The paper's five models: dpformer (tied + Re-Attention), transformer (tied), transformer-untied,
    gru, lstm (tied). norm / ffn_dim shape the Transformers' blocks (see `TransformerRec`); item_dim < d
    factorises the vanilla Transformers' item table (`check_item_dim`)."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    if n_items < 1 or maxlen < 1 or d < 1:
        raise ValueError("n_items, maxlen and d must be >= 1")
    if d % heads:
        raise ValueError(f"d={d} must be divisible by heads={heads}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if ffn_dim is not None and int(ffn_dim) < 1:
        raise ValueError(f"ffn_dim must be >= 1, got {ffn_dim}")
    if item_dim is not None:
        check_item_dim(name, item_dim, d)
    if prior and name not in ("dpformer", "transformer", "transformer-untied"):
        raise ValueError(f"prior (the transition release in the logits) is for the Transformers, got {name!r}")
    if name in ("gru", "lstm"):
        return RNNRec(n_items=n_items, d=d, dropout=dropout, tied=True, cell=name, maxlen=maxlen)
    return TransformerRec(n_items=n_items, d=d, dropout=dropout, tied=(name != "transformer-untied"),
                          heads=heads, blocks=blocks, maxlen=maxlen, activation=activation,
                          reattention=(name == "dpformer"), norm=norm, ffn_dim=ffn_dim, item_dim=item_dim,
                          prior=bool(prior))


@jax.custom_vjp
def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """−log softmax(logits)[target] per row (float32). The backward pass reuses the softmax saved by the
    forward (p − onehot): one pass of exps over the [rows, M+1] logits instead of two, the largest
    elementwise cost of full-softmax training."""
    return _cross_entropy_fwd(logits, targets)[0]


def _cross_entropy_fwd(logits, targets):
    z = logits.astype(jnp.float32)
    z = z - jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z)
    s = jnp.sum(e, axis=-1, keepdims=True)
    nll = jnp.log(s[..., 0]) - jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    return nll, ((e / s).astype(logits.dtype), targets)  # p kept in the logits' dtype


def _cross_entropy_bwd(res, g):
    p, targets = res
    onehot = jax.nn.one_hot(targets, p.shape[-1], dtype=p.dtype)
    return (p - onehot) * g[..., None].astype(p.dtype), None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def next_item_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-sequence mean softmax cross-entropy over non-padding targets: logits [B, L, M+1], targets
    [B, L] (0 = no loss) -> [B] (0 for sequences without targets)."""
    return _per_sequence_mean(_cross_entropy(logits, targets), targets)


def _per_sequence_mean(nll: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean of nll [B, L] over each sequence's non-padding targets -> [B] (0 without targets)."""
    m = targets > 0
    return jnp.sum(jnp.where(m, nll, 0.0), -1) / jnp.maximum(m.sum(-1), 1).astype(nll.dtype)


def sampled_next_item_loss(logits: jax.Array, targets: jax.Array, negatives: jax.Array,
                           log_q: jax.Array | None = None) -> jax.Array:
    """Sampled-softmax version of `next_item_loss`: logits [B, L, 1+K] of [target, negatives [B, K]].

    log_q [M+1]: log of each item's sampling probability; the logits are corrected by −log q (the
    standard sampled-softmax correction, so popular negatives are not over-penalised; a constant for
    uniform negatives, None). A negative equal to the position's target is removed (accidental hit)."""
    if log_q is not None:
        logits = logits - jnp.concatenate([log_q[targets][..., None],
                                           jnp.broadcast_to(log_q[negatives][:, None, :], logits[..., 1:].shape)], -1)
    hit = negatives[:, None, :] == targets[..., None]
    logits = jnp.concatenate([logits[..., :1], jnp.where(hit, NEG, logits[..., 1:])], -1)
    return _per_sequence_mean(_cross_entropy(logits, jnp.zeros(targets.shape, jnp.int32)), targets)


def make_loss_fn(model: SeqRecModel, reatt: dict | None = None, deterministic: bool = False,
                 log_q: jax.Array | None = None):
    """loss_fn(params, batch, reatt=None) -> per-example losses [B] for the clipping engine.

    batch: {"input": [B, L], "target": [B, L], "key": [B] dropout keys (key of example 0 is used, so
    a batch of one gets its own key)} and, for a sampled softmax, "negatives": [B, K] (the same K items
    in every row: one draw per step shared by all users; log_q as in `sampled_next_item_loss`). The
    Re-Attention variances are never differentiated: `reatt` here (constants in a compiled step), or
    passed to the loss as the engine's `aux` (inputs of the step: a new release does not recompile)."""
    default_reatt = reatt

    def loss_fn(params: Any, batch: dict, reatt: dict | None = None) -> jax.Array:
        reatt = default_reatt if reatt is None else reatt
        rngs = None if deterministic else {"dropout": batch["key"][0]}
        negatives = batch.get("negatives")
        logits = model.apply(params, batch["input"], deterministic=deterministic, reatt=reatt, rngs=rngs,
                             targets=batch["target"] if negatives is not None else None, negatives=negatives)
        if negatives is None:
            return next_item_loss(logits, batch["target"])
        return sampled_next_item_loss(logits, batch["target"], negatives, log_q)
    return loss_fn


__all__ = ["MODELS", "NORMS", "PRIOR_HISTORY", "RNNRec", "SelfAttention", "TransformerRec", "check_item_dim", "make_loss_fn",
           "make_model", "next_item_loss", "sampled_next_item_loss", "transition_prior"]
