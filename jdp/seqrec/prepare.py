"""Everything a `jdp.seqrec.train` run fixes before its loop (`prepare` -> `Run`): the model, the releases and σ
(`releases.privacy_setup`), the starting parameters, the step functions (`dp_sgd`'s accumulate / apply, or the
NON-PRIVATE reference's) and the evaluation, their compilations overlapped in a thread pool."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from dp_accounting import dp_event as dpe

from jdp import accounting
from jdp.clipping.dp_sgd import clipped_accumulate, dp_sgd, dp_sgd_event, poisson_indices
from jdp.clipping.optimizers import dp_adam_bc, noise_variance
from jdp.clipping.sparse_rows import SparseRows
from jdp.seqrec import reattention as ra
from jdp.seqrec import transitions as tr
from jdp.seqrec.batches import check_negatives, negative_probs, step_batches
from jdp.seqrec.config import TrainConfig
from jdp.seqrec.data import SeqData, item_presence
from jdp.seqrec.evaluate import evaluation_shapes, make_rank_fn_reatt
from jdp.seqrec.item_table import (freeze_item_rows, freeze_item_table_loss, frozen_item_rows, start_from_item_table,
                                   zero_item_rows)
from jdp.seqrec.models import make_loss_fn, make_model
from jdp.seqrec.nonprivate import nonprivate_step
from jdp.seqrec.releases import (check_item_init_k, item_start_k, item_start_noise, privacy_setup,
                                 uses_transition_prior)


@dataclasses.dataclass
class Run:
    """One call of `train`: what its loop steps with (fixed before it starts) and the loop's state."""
    data: SeqData
    cfg: TrainConfig
    N: int
    q: float
    steps: int
    model: Any
    pool: concurrent.futures.ThreadPoolExecutor
    windows: np.ndarray
    k_noise: jax.Array
    k_sample: jax.Array
    k_dropout: jax.Array
    k_neg: jax.Array
    report: accounting.PrivacyReport | None
    sigma: float
    counts_rel: np.ndarray | None
    item_start: tr.TransitionModel | None
    params: Any                      # the starting parameters (also the evaluation's precompilation shapes)
    neg_probs: np.ndarray | None
    state: Any = None                # DPSGDState (or the reference's PlainState)
    zeros: Any = None                # params -> the empty accumulator of `accumulate`
    accumulate: Any = None
    apply: Any = None
    apply_ready: Any = None          # futures of compilations beside the first step
    first_step_ready: Any = None
    prior: bool = False              # the transition prior in the logits (`releases.uses_transition_prior`)
    reatt: dict | None = None
    rank_fn: Any = None
    eval_windows: tuple = ()
    eval_shapes: list = dataclasses.field(default_factory=list)

    @property
    def private(self) -> bool:
        return self.cfg.epsilon is not None

    def precompile_evaluation(self) -> None:
        for shape in self.eval_shapes:
            self.pool.submit(precompile, self.rank_fn, self.params, *shape)

    def epsilon_after(self, done: int) -> float:
        """ε of the releases before training and `done` DP-SGD steps (privacy_setup appends the steps last)."""
        fixed = [r.composed_event() for r in self.report.releases[:-1]]
        return accounting.compute_epsilon(dpe.ComposedDpEvent(fixed + [dp_sgd_event(self.sigma, self.q, done)]),
                                          self.cfg.delta)


def prepare(data: SeqData, cfg: TrainConfig, plan: tuple[int, float, int], key: jax.Array, public_item_counts,
            resuming: bool, initial_params, evaluate_test: bool) -> Run:
    """Everything before `train`'s loop: the model, the releases and σ (`privacy_setup`), the starting parameters,
    the step functions (`dp_sgd`'s accumulate / apply, or the NON-PRIVATE reference's) and the evaluation."""
    (N, q, steps), L, M = plan, data.maxlen, data.n_items
    if public_item_counts is not None and (cfg.model == "dpformer" or cfg.trainable_items):  # validate first
        if np.shape(public_item_counts) != (M + 1,):
            raise ValueError(f"public_item_counts must be a finite array of shape ({M + 1},)")
    if cfg.negatives:  # fail before any work (the accounting below takes seconds)
        check_negatives(cfg, M, cfg.model == "dpformer" or public_item_counts is not None)
    check_item_init_k(cfg, M)
    prior = uses_transition_prior(cfg, public_item_counts is not None)
    model = make_model(cfg.model, M, L, cfg.d, cfg.heads, cfg.blocks, cfg.dropout_rate(prior), cfg.activation,
                       cfg.norm, cfg.ffn_dim, cfg.item_dim, prior)
    k_init, k_hist, k_train = jax.random.split(key, 3)
    if initial_params is not None:  # refused before any release or compilation (abstract shapes only)
        initial_params = _check_initial_params(initial_params,
                                               jax.eval_shape(model.init, k_init, jnp.zeros((1, L), jnp.int32)))

    # compilations off the critical path: XLA releases the GIL while it compiles, so on a first run the
    # calibration and the initialisation's compilation overlap the first step's clipped accumulation (its program
    # does not read σ), and the update's and the evaluation's compilations overlap the first step (`precompile`)
    pool = concurrent.futures.ThreadPoolExecutor(3, thread_name_prefix="jdp-compile")
    init = pool.submit(jax.jit(model.init), k_init, jnp.zeros((1, L), jnp.int32))
    k_noise, k_sample, k_dropout = jax.random.split(k_train, 3)
    windows = np.array(sorted({int(b) for b in cfg.length_buckets if 0 < b < L} | {L}))
    loss_fn = _loss_of(model, cfg)
    first_step_ready = None
    if cfg.epsilon is not None and not cfg.negatives and not resuming:
        # traced here, before the calibration starts: both are Python and would take turns on the GIL. The prior's
        # table has a row per candidate of the release: K is public (`item_start_k`, milliseconds)
        public = public_item_counts is not None
        prior_rows = item_start_k(data, cfg, item_start_noise(cfg, public)) + 1 if prior else 0
        lowered = _lower_first_step(data, cfg, model, loss_fn, k_init, N, q, windows, k_sample, k_dropout, prior_rows)
        first_step_ready = pool.submit(lambda: [program.compile() for program in lowered])
    report, sigma, counts_rel, item_start = pool.submit(privacy_setup, data, cfg, k_hist, public_item_counts).result()
    run = Run(data, cfg, N, q, steps, model, pool, windows, k_noise, k_sample, k_dropout,
              jax.random.fold_in(k_train, 0x6E6567),  # negatives' own stream (data-independent)
              report, sigma, counts_rel, item_start, init.result(), None, first_step_ready=first_step_ready,
              prior=prior)
    frozen = _starting_params(run, initial_params, public_item_counts)
    log_q = None
    if cfg.negatives:
        run.neg_probs = negative_probs(data, cfg, counts_rel if cfg.model == "dpformer" else public_item_counts,
                                       public_item_counts is not None, report)
        if run.neg_probs is not None:
            log_q = jnp.log(jnp.asarray(np.concatenate([[1.0], run.neg_probs]), jnp.float32))
    _step_functions(run, _loss_of(model, cfg, log_q=log_q) if log_q is not None else loss_fn, frozen)
    _evaluation(run, evaluate_test)
    return run


def _loss_of(model, cfg: TrainConfig, **kw):
    """The model's per-user loss (Re-Attention's inputs: an input of the step, `aux`, not a constant)."""
    loss = make_loss_fn(model, **kw)
    return freeze_item_table_loss(loss) if cfg.freeze_item_table else loss


def _starting_params(run: Run, initial_params, public_item_counts) -> np.ndarray | None:
    """Sets run.params (the caller's, the item-table start or the model's initialisation, frozen item rows at 0);
    returns the frozen item rows (None: every row trains)."""
    cfg, data, M = run.cfg, run.data, run.data.n_items
    if initial_params is not None:  # the caller's starting point (public, or post-processing of a release),
        run.params = initial_params  # checked and cast by `prepare` before any work
    elif run.item_start is not None:
        run.params = start_from_item_table(run.params, run.item_start)
    frozen = None
    if cfg.trainable_items:  # post-processing of public / released counts (exact only in a NON-PRIVATE run)
        counts = (run.counts_rel if run.private else public_item_counts if public_item_counts is not None
                  else item_presence(data.train_input, data.train_target, M))
        frozen = frozen_item_rows(counts, cfg.trainable_items)
        run.params = zero_item_rows(run.params, frozen)
    if cfg.freeze_item_table:  # not differentiated (freeze_item_table_loss); the noise drawn for it is discarded
        frozen = np.ones(M + 1, bool)
    return frozen


def optimizer(cfg: TrainConfig, steps: int, noise_var: float) -> optax.GradientTransformation:
    """`cfg.optimizer` on the noisy mean gradient, whose noise variance per coordinate is `noise_var` = (σC/B)²
    (public; 0 for the NON-PRIVATE reference), at the warm-up-then-linear-decay schedule; weight decay decoupled."""
    schedule = lr_schedule(cfg.lr, steps, cfg.warmup_frac)
    if cfg.optimizer == "adam-bc":
        return dp_adam_bc(schedule, noise_var, gamma_over_noise=cfg.adam_bc_gamma, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "sgd-momentum":
        return optax.chain(optax.add_decayed_weights(cfg.weight_decay), optax.sgd(schedule, momentum=0.9))
    return optax.adamw(schedule, weight_decay=cfg.weight_decay)


def _step_functions(run: Run, loss_fn, frozen) -> None:
    """The optimiser, the DP-SGD step of jdp.clipping (`dp_sgd` at the σ of `privacy_setup`: its accumulate and
    apply) or the NON-PRIVATE reference's, the starting state, and Re-Attention's inputs."""
    cfg, M = run.cfg, run.data.n_items
    opt = optimizer(cfg, run.steps, noise_variance(run.sigma, cfg.l2_clip, cfg.batch_size) if run.private else 0.0)
    if frozen is not None:
        opt = optax.chain(opt, freeze_item_rows(frozen))
    if jnp.issubdtype(run.k_noise.dtype, jax.dtypes.prng_key):
        run.k_noise = jax.random.key_data(run.k_noise)  # raw key bits: the noise key lives in opt_state
    if run.private:
        dp = dp_sgd(loss_fn, opt, num_examples=run.N, batch_size=cfg.batch_size, l2_clip=cfg.l2_clip,
                    delta=cfg.delta, steps=run.steps, noise_multiplier=run.sigma, method=cfg.clipping,
                    normalize=cfg.normalize, unit="user", batch_chunk=cfg.batch_chunk, sparse_rows=sparse_rows(cfg))
        run.zeros, run.accumulate, run.apply = dp.zeros, dp.accumulate, dp.apply
        # the noisy update compiles as soon as σ is known, beside the state's allocation and the steps below
        state_shape = jax.eval_shape(dp.init, run.params, run.k_noise)
        run.apply_ready = run.pool.submit(precompile, run.apply, state_shape, jax.eval_shape(dp.zeros, run.params))
        run.state = jax.jit(dp.init)(run.params, run.k_noise)  # one program, not an eager op per leaf
    else:  # NON-PRIVATE reference: plain gradient sums, the same sampling, schedule and optimiser
        run.state, run.accumulate, run.apply = nonprivate_step(loss_fn, opt, run.params, cfg.batch_size,
                                                               cfg.batch_chunk)
        run.zeros = functools.partial(jax.tree.map, jnp.zeros_like)
        run.apply_ready = run.pool.submit(precompile, run.apply, run.state, run.state.params)
    if cfg.model == "dpformer":
        if run.counts_rel is None:  # non-private reference: zero noise -> Re-Attention is the identity
            run.counts_rel = np.ones(M + 1)
        run.reatt = reatt_inputs(*ra.effective_variances(run.sigma, cfg.l2_clip, cfg.batch_size, run.q,
                                                         run.counts_rel, cfg.error_scale))
    if run.prior:  # the release's scores: inputs of the step beside Re-Attention's (never differentiated)
        prior = {k: jnp.asarray(v) for k, v in run.item_start.prior_inputs().items()}
        run.reatt = {**(run.reatt or {}), **prior}


def _evaluation(run: Run, evaluate_test: bool) -> None:
    """The ranking function and the shapes the evaluation will compile."""
    cfg, data = run.cfg, run.data
    # one compilation for every evaluation; the test metrics under the other history protocol come from
    # the same forward pass
    run.rank_fn = make_rank_fn_reatt(run.model, cfg.mask_history, run.reatt, both_protocols=True)
    # evaluation is one forward per user: the powers of two among the windows cost little extra compute
    # and save most compilations (each window x chunk size is one; they dominate evaluation on a GPU)
    run.eval_windows = tuple(int(w) for w in cfg.length_buckets if int(w) > 0 and int(w) & (int(w) - 1) == 0)
    run.eval_shapes = evaluation_shapes([data.valid_input] + ([data.test_input] if evaluate_test else []),
                                        [data.valid_target] + ([data.test_target] if evaluate_test else []),
                                        cfg.eval_chunk, run.eval_windows)


def item_ids(batch: dict) -> jax.Array:
    """The item rows a user's training sequence touches (DP-FEST's ids): its input and target items (0: padding)."""
    return jnp.concatenate([batch["input"], batch["target"]], axis=1)


def sparse_rows(cfg: TrainConfig) -> SparseRows | None:
    """DP-FEST on the tied item table when cfg.sparse_item_rows (`jdp.clipping.sparse_rows`), else None."""
    if not cfg.sparse_item_rows:
        return None
    return SparseRows(("params", "item_embed", "embedding"), item_ids, cfg.sparse_ratio, cfg.sparse_threshold)


def lr_schedule(lr: float, steps: int, warmup_frac: float) -> optax.Schedule:
    """Linear warm-up over the first warmup_frac of the steps, then linear decay to 0."""
    warm = max(1, int(round(warmup_frac * steps)))
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warm),
                                 optax.linear_schedule(lr, 0.0, max(1, steps - warm))], [warm])


def _check_initial_params(initial, reference):
    """`initial` as float32 arrays, after checking it has `reference`'s tree structure and leaf shapes."""
    if jax.tree_util.tree_structure(initial) != jax.tree_util.tree_structure(reference):
        raise ValueError("initial_params must have the model's parameter structure (model.init's)")
    pairs = zip(jax.tree_util.tree_flatten_with_path(initial)[0], jax.tree_util.tree_leaves(reference))
    bad = [jax.tree_util.keystr(path) for (path, a), b in pairs if np.shape(a) != tuple(b.shape)]
    if bad:
        raise ValueError(f"initial_params: wrong shape at {', '.join(bad)}")
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), initial)


def reatt_inputs(w_var, emb_var) -> dict:
    """Re-Attention's released variances as the step's `aux` input (values, not constants of the program)."""
    return {"w_var": jnp.float32(w_var), "emb_var": jnp.asarray(emb_var, jnp.float32)}


def _lower_first_step(data, cfg, model, loss_fn, k_init, N, q, windows, k_sample, k_dropout, prior_rows: int) -> list:
    """The clipped accumulation of the first step's chunk shapes (the sample is Poisson at rate q, known before σ),
    traced and lowered on abstract parameters: the same jitted function `dp_sgd(...).accumulate` returns later, so
    compiling these fills its cache. prior_rows: the transition prior's table rows (0: no prior)."""
    L, M = data.maxlen, data.n_items
    params = jax.eval_shape(model.init, k_init, jnp.zeros((1, L), jnp.int32))
    aux = jax.eval_shape(reatt_inputs, 1.0, np.ones(M + 1, np.float32)) if cfg.model == "dpformer" else None
    if prior_rows:  # `transitions.TransitionModel.prior_inputs`' shapes
        aux = {**(aux or {}), "prior_slot": jax.ShapeDtypeStruct((M + 1,), jnp.int32),
               "prior_table": jax.ShapeDtypeStruct((prior_rows, M + 1), jnp.float32)}
    accumulate = clipped_accumulate(loss_fn, float(cfg.l2_clip), cfg.clipping, bool(cfg.normalize), cfg.batch_chunk,
                                    sparse_rows=sparse_rows(cfg))
    acc = params if not cfg.sparse_item_rows else (params, jax.ShapeDtypeStruct((M + 1,), jnp.float32))
    idx = poisson_indices(jax.random.fold_in(k_sample, 0), N, q)
    idx = idx[idx < data.n_users]
    shapes = {}
    for _, batch, mask in step_batches(data, idx, windows, cfg.chunk_rows, jax.random.fold_in(k_dropout, 0)):
        spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (batch, mask))
        shapes[(batch["input"].shape, mask.shape)] = spec
    return [accumulate.lower(params, acc, batch, mask, aux) for batch, mask in shapes.values()]


def precompile(fn, *args) -> None:
    """Compiles the jitted `fn` (or a functools.partial of one) for `args` (arrays or ShapeDtypeStructs) into its
    own cache, so a later call of the same shapes runs at once."""
    if isinstance(fn, functools.partial):
        fn.func.lower(*fn.args, *args, **fn.keywords).compile()
    else:
        fn.lower(*args).compile()


__all__ = ["Run", "item_ids", "lr_schedule", "precompile", "prepare", "reatt_inputs", "sparse_rows"]
