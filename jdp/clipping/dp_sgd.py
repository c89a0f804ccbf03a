"""DP-SGD on top of `clipped_grad`: Poisson sampling with static-shape padding, an optax noise
transformation, a jit-compiled step and a PrivacyReport from dp_accounting.

Mechanism per step: a Poisson sample (each unit independently with probability q), the sum
of clipped per-unit gradients (L2 sensitivity S = C, or sqrt(sum C_k^2) for per-layer clipping), plus
N(0, (sigma S)^2 I), divided by the PUBLIC expected batch size q N (never by the private sample size).
Accounting: `SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), steps)` under
add/remove of one unit, composed by dp_accounting (RDP by default, PLD on request).

Unit of privacy: one row of the training data (an example, or a user when each row holds one user's
whole sequence); neighbouring relation: add/remove one such row.

Many devices: `dp_sgd(..., mesh=)` splits each padded batch's rows over the mesh's data axis; every device clips
its rows and one all-reduce adds the clipped sums before the noise is drawn once (`jdp.clipping.sharding`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from dp_accounting import dp_event as dpe

from jdp import noise
from jdp.accounting import ADD_OR_REMOVE_ONE, PrivacyReport, Release, calibrate, compute_epsilon
from jdp.clipping.engine import METHODS, check_batch_chunk, clipped_grad
from jdp.clipping.sharding import DATA_AXIS, check_mesh, sharded_sums
from jdp.clipping.sparse_rows import SparseRows, noisy_selected_rows, select_rows, split_noise
from jdp.sampling import poisson_indices, poisson_keep, poisson_sample, poisson_sample_jit
from jdp.validation import check_positive, check_privacy


# ---------------------------------------------------------------------------------------------------
# Accounting.
def dp_sgd_event(noise_multiplier: float, sampling_rate: float, steps: int) -> dpe.DpEvent:
    """The dp_accounting event of `steps` Poisson-sampled Gaussian steps."""
    check_positive(noise_multiplier, "noise_multiplier")
    q = check_positive(sampling_rate, "sampling_rate")
    if q > 1:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
    if int(steps) < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(float(noise_multiplier))),
                                   int(steps))


def calibrate_noise_multiplier(epsilon: float, delta: float, sampling_rate: float, steps: int,
                               accountant: str = "rdp", before: Sequence[dpe.DpEvent] | None = None) -> float:
    """Smallest noise multiplier sigma whose `dp_sgd_event` spends at most (epsilon, delta); with `before` (the
    dp_accounting events of releases made before training, e.g. `Release.composed_event()` of each), the smallest
    whose steps composed after them spend at most (epsilon, delta) in total."""
    epsilon, delta = check_privacy(epsilon, delta, None)
    dp_sgd_event(1.0, sampling_rate, steps)  # validates q and steps

    def event(s):
        steps_event = dp_sgd_event(s, sampling_rate, steps)
        return steps_event if before is None else dpe.ComposedDpEvent(list(before) + [steps_event])
    return calibrate(event, epsilon, delta, bracket=(1e-2, 1e4), accountant=accountant)


DP_SGD_RELEASE = "dp-sgd noisy clipped gradient sum"
DP_FEST_RELEASE = "dp-sgd noisy clipped gradient sum on rows selected by noisy counts (DP-FEST)"


def dp_sgd_release(noise_multiplier: float, sampling_rate: float, sensitivity: float, steps: int,
                   name: str = DP_SGD_RELEASE) -> Release:
    """The report's line for `steps` DP-SGD steps: each a Poisson-sampled (rate q) Gaussian release of a clipped sum
    of L2 sensitivity `sensitivity`, noise std noise_multiplier * sensitivity."""
    if int(steps) < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    event = dpe.PoissonSampledDpEvent(sampling_rate, dpe.GaussianDpEvent(noise_multiplier))
    return Release(name, event, sensitivity=float(sensitivity), noise_scale=float(noise_multiplier * sensitivity),
                   count=int(steps))


# ---------------------------------------------------------------------------------------------------
# Poisson sampling with a static shape (the sampler itself: `jdp.sampling`).
def default_max_batch_size(num_examples: int, sampling_rate: float, multiple: int = 8) -> int:
    """Expected size + 6 standard deviations (overflow probability < 1e-8), rounded up."""
    mean = num_examples * sampling_rate
    size = mean + 6.0 * math.sqrt(max(mean * (1 - sampling_rate), 1.0)) + 1
    return int(min(num_examples, multiple * math.ceil(size / multiple)))


# ---------------------------------------------------------------------------------------------------
# optax transformation.
class DPAggregateState(NamedTuple):
    key: jax.Array
    count: jax.Array


def dp_aggregate(noise_multiplier: float, sensitivity: float, expected_batch_size: float,
                 key: jax.Array, sparse_rows: SparseRows | None = None) -> optax.GradientTransformation:
    """optax transformation: (sum of clipped grads + N(0, (sigma S)^2)) / expected batch size.

    Feed it `ClippedGrad.grad_sum` (a SUM over units, sensitivity S), put it first in an optax.chain.
    The noise key is split each step from `key` (explicit, reproducible). The noise is added in float32 (or the
    sum's wider dtype); given `params`, the noisy mean is then cast to each parameter's dtype.

    `sparse_rows` (DP-FEST on one table, `jdp.clipping.sparse_rows`): the updates are the pair (clipped grad sum,
    the table's row counts); sigma splits into (σ_g, σ_r) = `split_noise(sigma, ratio)`, one Gaussian of
    multiplier sigma per step; the rows whose counts + N(0, σ_r²) exceed threshold·σ_r are selected, the sum gets
    N(0, (σ_g S)²), and the table keeps its selected rows only (every other row's update is 0).
    """
    sigma = check_positive(noise_multiplier, "noise_multiplier")
    S = check_positive(sensitivity, "sensitivity")
    denom = check_positive(expected_batch_size, "expected_batch_size")
    if sparse_rows is not None:
        sigma, sigma_r = split_noise(sigma, sparse_rows.ratio)

    def init_fn(params):
        del params
        return DPAggregateState(key=jnp.asarray(key), count=jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None):
        new_key, sub = jax.random.split(state.key)
        if sparse_rows is not None:
            updates, counts = updates
            sub, k_select, k_table = jax.random.split(sub, 3)
        # the sum and its noise in float32 whatever the parameters' dtype (a bfloat16 Gaussian has 8 bits);
        # the cast to the parameters' dtype comes after the noise: post-processing of the release
        updates = jax.tree.map(lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32)), updates)
        if sparse_rows is None:
            noisy = noise.add_gaussian_tree(sub, updates, sigma * S)
        else:  # the table's noise is its own draw, on the selected rows only (the other leaves' draw skips it)
            selected = select_rows(k_select, counts, sigma_r, sparse_rows.threshold * sigma_r)
            rest = jax.tree_util.tree_map_with_path(lambda p, g: g[:0] if sparse_rows.is_table(p) else g, updates)
            noisy = jax.tree_util.tree_map_with_path(
                lambda p, g, n: noisy_selected_rows(k_table, g, selected, sigma * S) if sparse_rows.is_table(p) else n,
                updates, noise.add_gaussian_tree(sub, rest, sigma * S))
        noisy = jax.tree.map(lambda g: g / denom, noisy)
        if params is not None:
            noisy = jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), noisy, params)
        return noisy, DPAggregateState(new_key, state.count + 1)

    return optax.GradientTransformation(init_fn, update_fn)


def _is_aggregate(x) -> bool:
    return isinstance(x, DPAggregateState)


def without_noise_key(state: Any) -> Any:
    """`state` (a DPSGDState, an opt_state or any tree holding `dp_aggregate` states) with each noise key zeroed:
    what a checkpoint should hold. The key generates the noise of every later step, so a file holding it beside
    any later model would let its reader subtract that noise and see those steps' clipped sums."""
    return jax.tree.map(lambda s: s._replace(key=jnp.zeros_like(s.key)) if _is_aggregate(s) else s, state,
                        is_leaf=_is_aggregate)


def with_noise_key(state: Any, key: jax.Array) -> Any:
    """Inverse of `without_noise_key` for a run whose noise key was `key` (raw key bits, as given to `init`): each
    `dp_aggregate` state gets the key it holds after its `count` updates (each update splits it once)."""
    def advance(s):
        if not _is_aggregate(s):
            return s
        k = jax.lax.fori_loop(0, s.count, lambda _, k: jax.random.split(k)[0], jnp.asarray(key))
        return s._replace(key=k)
    return jax.tree.map(advance, state, is_leaf=_is_aggregate)


# ---------------------------------------------------------------------------------------------------
# The step helper.
class DPSGDState(NamedTuple):
    params: Any
    opt_state: Any
    step: jax.Array


@dataclasses.dataclass(frozen=True)
class DPSGD:
    """DP-SGD for a Flax/JAX loss with Poisson sampling and accounting (built by `dp_sgd`).

    Unit of privacy: one row of `data` (an example; a user when a row is a user's whole sequence);
    neighbouring relation: add/remove one row. Every step releases one noisy clipped-gradient sum.
    """
    loss_fn: Callable
    optimizer: optax.GradientTransformation
    num_examples: int
    sampling_rate: float
    steps: int
    l2_clip: float
    noise_multiplier: float
    delta: float
    max_batch_size: int
    method: str = "auto"
    normalize: bool = False
    accountant: str = "rdp"
    unit: str = "example"
    batch_chunk: int | str | None = "auto"   # see `clipped_grad`
    mesh: Any = None                          # a jax.sharding.Mesh: rows split over `data_axis` (see dp_sgd)
    data_axis: str = DATA_AXIS
    sparse_rows: SparseRows | None = None     # DP-FEST on one embedding table (see dp_sgd)

    @property
    def expected_batch_size(self) -> float:
        return self.num_examples * self.sampling_rate

    def event(self, steps: int | None = None) -> dpe.DpEvent:
        return dp_sgd_event(self.noise_multiplier, self.sampling_rate, self.steps if steps is None else steps)

    def epsilon(self, steps: int | None = None) -> float:
        return compute_epsilon(self.event(steps), self.delta, self.accountant)

    def report(self, steps: int | None = None) -> PrivacyReport:
        """PrivacyReport of `steps` (default: all planned) DP-SGD steps."""
        n = self.steps if steps is None else int(steps)
        rep = PrivacyReport(self.delta, unit=self.unit, relation=ADD_OR_REMOVE_ONE, accountant=self.accountant)
        name = DP_SGD_RELEASE if self.sparse_rows is None else DP_FEST_RELEASE
        return rep.add_release(dp_sgd_release(self.noise_multiplier, self.sampling_rate, self.l2_clip, n, name))

    def transform(self, key: jax.Array) -> optax.GradientTransformation:
        return optax.chain(dp_aggregate(self.noise_multiplier, self.l2_clip, self.expected_batch_size, key,
                                        self.sparse_rows), self.optimizer)

    def init(self, params: Any, key: jax.Array) -> DPSGDState:
        """`key` seeds the noise of every step."""
        if self.sparse_rows is not None:
            self.sparse_rows.n_rows(params)  # the table exists: refused before any step otherwise
        return DPSGDState(params, self.transform(key).init(params), jnp.zeros((), jnp.int32))

    def zeros(self, params: Any) -> Any:
        """The empty accumulator of `accumulate`: zeros like params (with `sparse_rows`: and the table's counts)."""
        zero = jax.tree.map(jnp.zeros_like, params)
        if self.sparse_rows is None:
            return zero
        return zero, jnp.zeros(self.sparse_rows.n_rows(params), jnp.float32)

    def sample(self, key: jax.Array):
        """(indices, mask) of one whole Poisson sample, padded to `max_batch_size` rows: never truncated and never
        an error. A sample larger than `max_batch_size` (probability < 1e-8 per step at the default size) is
        padded to the smallest multiple of `max_batch_size` that holds it, so the step is still the accounted
        mechanism; only its shape (a compilation, memory) differs. Raising or truncating instead would make the
        output depend on whether one more row was sampled: a release the report does not cover."""
        B = self.max_batch_size
        idx, mask, count = poisson_sample_jit(key, self.num_examples, self.sampling_rate, B)
        size = B * max(1, -(-int(count) // B))
        if size > B:  # rare: the same sample (same key), padded to k·B rows
            idx, mask, _ = poisson_sample_jit(key, self.num_examples, self.sampling_rate, size)
        return idx, mask

    def sample_indices(self, key: jax.Array) -> np.ndarray:
        """The rows of one Poisson sample, all of them (variable size, on the host): for callers that lay
        the sample out in their own physical chunks (e.g. by sequence length) and `accumulate` them."""
        return poisson_indices(key, self.num_examples, self.sampling_rate)

    def _clipped(self, params: Any, batch: Any, mask: jax.Array, aux: Any = None):
        return _sums_fn(self.loss_fn, self.l2_clip, self.method, self.normalize, self.batch_chunk, self.mesh,
                        self.data_axis, self.sparse_rows)(params, batch, mask, aux)

    def _apply(self, state: DPSGDState, grad_sum: Any) -> DPSGDState:
        tx = self.transform(jax.random.PRNGKey(0))  # the noise key lives in opt_state
        updates, opt_state = tx.update(grad_sum, state.opt_state, state.params)
        return DPSGDState(optax.apply_updates(state.params, updates), opt_state, state.step + 1)

    def _step(self, state: DPSGDState, batch: Any, mask: jax.Array, aux: Any = None):
        g, sums = self._clipped(state.params, batch, mask, aux)
        m = jnp.maximum(sums["count"], 1)
        metrics = {"loss": sums["loss_sum"] / m, "num_nonfinite": sums["num_nonfinite"],
                   "frac_clipped": sums["num_clipped"] / m}
        return self._apply(state, g), metrics

    @property
    def step(self) -> Callable:
        """jit-compiled step(state, batch [max_batch_size rows], mask, aux=None) -> (state, metrics); `aux`:
        see `clipped_grad` (the loss is then loss_fn(params, batch, aux)).

        metrics are private diagnostics (loss, clipped fraction, num_nonfinite: unmasked rows dropped for a
        non-finite loss or gradient): do not publish them unaccounted, and do not branch or stop on them.
        """
        return _jitted(self, "_step")

    @property
    def accumulate(self) -> Callable:
        """jit-compiled accumulate(params, grad_sum, batch, mask, aux=None) -> (grad_sum + Σ clipped grads of the
        batch, sums {loss_sum, count, num_clipped, num_nonfinite}): one physical chunk of a step whose
        Poisson sample (`sample_indices`) is processed in several chunks, each row of the sample in exactly
        one chunk (chunks may have different shapes). Start from `zeros(params)`; finish with `apply`.
        The sums are private diagnostics. The same function as `clipped_accumulate` of these clipping settings
        (it does not read the noise). With a mesh, each chunk's rows must split evenly over its data axis."""
        return clipped_accumulate(self.loss_fn, self.l2_clip, self.method, self.normalize, self.batch_chunk,
                                  self.mesh, self.data_axis, self.sparse_rows)

    @property
    def apply(self) -> Callable:
        """jit-compiled apply(state, grad_sum) -> state: the noisy release of the accumulated clipped sum
        (`dp_aggregate`: + N(0, (σC)²), / expected batch size) and the optimizer update: one accounted step."""
        return _jitted(self, "_apply")

    def fit(self, params: Any, data: Any, key: jax.Array, steps: int | None = None,
            progress: bool = True) -> tuple[Any, PrivacyReport, list]:
        """Runs `steps` (default all planned) DP-SGD steps on `data` (pytree of arrays [N, ...]).

        Returns (params, report, history). Every requested step runs, whatever the data: no property of the
        private data stops the loop or raises. A sampled row whose loss or gradient is not finite contributes
        nothing (the sensitivity bound holds) and is counted. `history` holds one dict per step of PRIVATE
        diagnostics, computed from the sampled rows without noise and not covered by the report: `loss` (mean
        over the sample), `frac_clipped`, `num_nonfinite` (sampled rows dropped for a non-finite loss or
        gradient). They are never printed (`progress` shows only the step count); do not publish them
        unaccounted.
        """
        from tqdm.auto import tqdm
        n = self.steps if steps is None else int(steps)
        if n > self.steps:
            raise ValueError(f"steps={n} exceeds the {self.steps} steps the noise was calibrated for")
        sizes = {int(np.shape(x)[0]) for x in jax.tree.leaves(data)}
        if sizes != {self.num_examples}:
            raise ValueError(f"data must have {self.num_examples} rows (num_examples), got {sorted(sizes)}")
        k_noise, k_sample = jax.random.split(key)
        state = self.init(params, k_noise)
        gather = jax.jit(lambda d, i: jax.tree.map(lambda x: jnp.take(x, i, axis=0), d))
        history = []
        for t in tqdm(range(n), disable=not progress, desc="dp-sgd"):
            idx, mask = self.sample(jax.random.fold_in(k_sample, t))
            if idx.shape[0] == self.max_batch_size:
                state, metrics = self.step(state, gather(data, idx), mask)
            else:  # an oversized sample (k·max_batch_size rows): the same step, accumulated in k chunks
                state, metrics = self._chunked_step(state, data, idx, mask, gather)
            history.append({k: float(v) for k, v in metrics.items()})  # private diagnostics, never printed
        return state.params, self.report(n), history

    def _chunked_step(self, state: DPSGDState, data: Any, idx: jax.Array, mask: jax.Array, gather: Callable):
        B = self.max_batch_size
        acc = self.zeros(state.params)
        tot = {"loss_sum": 0.0, "count": 0, "num_clipped": 0, "num_nonfinite": 0}
        for s in range(0, idx.shape[0], B):
            acc, sums = self.accumulate(state.params, acc, gather(data, idx[s:s + B]), mask[s:s + B])
            tot = {k: tot[k] + sums[k] for k in tot}
        m = jnp.maximum(tot["count"], 1)
        metrics = {"loss": tot["loss_sum"] / m, "num_nonfinite": tot["num_nonfinite"],
                   "frac_clipped": tot["num_clipped"] / m}
        return self.apply(state, acc), metrics


@functools.lru_cache(maxsize=32)  # keyed on the frozen config's value: equal configs share one compiled step
def _jitted(cfg: DPSGD, name: str):
    return jax.jit(getattr(cfg, name))


def _clipped_sums(loss_fn, l2_clip, method, normalize, batch_chunk, params, batch, mask, aux):
    cg = clipped_grad(loss_fn, params, batch, l2_clip=l2_clip, mask=mask, method=method, normalize=normalize,
                      aux=aux, batch_chunk=batch_chunk)
    keep = jnp.asarray(mask) != 0
    # `where`, not `* mask`: a padding row's NaN loss must not reach the metrics (0 * NaN = NaN)
    sums = {"loss_sum": jnp.sum(jnp.where(keep, cg.loss, 0.0)), "count": jnp.sum(keep),
            "num_clipped": jnp.sum(keep & (cg.norms > l2_clip)), "num_nonfinite": cg.num_nonfinite}
    return cg.grad_sum, sums


def _sums_fn(loss_fn, l2_clip, method, normalize, batch_chunk, mesh, data_axis, sparse_rows=None) -> Callable:
    """(params, batch, mask, aux) -> (clipped grad_sum, sums): on one device, or split over the mesh's data axis;
    with `sparse_rows`, ((grad_sum, the table's row counts), sums)."""
    fn = functools.partial(_clipped_sums, loss_fn, l2_clip, method, normalize, batch_chunk)
    fn = fn if mesh is None else sharded_sums(fn, mesh, data_axis)
    if sparse_rows is None:
        return fn

    def with_counts(params, batch, mask, aux):
        g, sums = fn(params, batch, mask, aux)
        return (g, sparse_rows.counts(params, batch, mask)), sums
    return with_counts


def clipped_accumulate(loss_fn: Callable, l2_clip: float, method: str = "auto", normalize: bool = False,
                       batch_chunk: int | str | None = "auto", mesh: Any = None,
                       data_axis: str = DATA_AXIS, sparse_rows: SparseRows | None = None) -> Callable:
    """`DPSGD.accumulate` for these clipping settings (the same jitted function: equal settings share it):
    accumulate(params, grad_sum, batch, mask, aux=None) -> (grad_sum + Σ clipped grads, sums). Its program
    does not read the noise multiplier, so a caller can compile it while σ is still being calibrated.

    Releases nothing by itself: adding or removing one row moves the sum by at most `l2_clip` (with
    `normalize`, exactly `l2_clip` unless its gradient is zero); only `DPSGD.apply` adds the noise that the
    report accounts. `mesh`: see `dp_sgd`. With `sparse_rows` the accumulator is the pair (grad_sum, the
    table's row counts), whose counts move by at most 1 (`sparse_rows.row_counts`)."""
    check_mesh(mesh, data_axis)
    return _clipped_accumulate(loss_fn, float(l2_clip), method, bool(normalize), batch_chunk, mesh, data_axis,
                               sparse_rows)


@functools.lru_cache(maxsize=32)
def _clipped_accumulate(loss_fn, l2_clip, method, normalize, batch_chunk, mesh, data_axis, sparse_rows):
    sums_fn = _sums_fn(loss_fn, l2_clip, method, normalize, batch_chunk, mesh, data_axis, sparse_rows)

    def accumulate(params, grad_sum, batch, mask, aux=None):
        g, sums = sums_fn(params, batch, mask, aux)
        return jax.tree.map(jnp.add, grad_sum, g), sums
    return jax.jit(accumulate)


def dp_sgd(loss_fn: Callable, optimizer: optax.GradientTransformation, *, num_examples: int,
           batch_size: float, l2_clip: float, delta: float, epochs: float | None = None,
           steps: int | None = None, epsilon: float | None = None, noise_multiplier: float | None = None,
           method: str = "auto", normalize: bool = False, max_batch_size: int | None = None,
           accountant: str = "rdp", unit: str = "example", batch_chunk: int | str | None = "auto",
           mesh: Any = None, data_axis: str = DATA_AXIS, sparse_rows: SparseRows | None = None) -> DPSGD:
    """Builds a DPSGD helper; the noise multiplier is calibrated to (epsilon, delta) for Poisson
    sampling at rate batch_size / num_examples over the planned steps (or given explicitly).

    Unit of privacy: one row of the training data (`unit` names it); add/remove-one neighbours.
    `batch_chunk`: examples per pass of the clipping engine (`clipped_grad`; "auto": cache-sized chunks on CPU).
    `mesh`: a `jax.sharding.Mesh` with axis `data_axis` (e.g. `jdp.clipping.sharding.data_mesh()`): each padded
    batch's rows are split over that axis, each device clips its own rows (so per device `batch_chunk` applies),
    the clipped sums are all-reduced and the noise is drawn once from the replicated key. The same mechanism and
    report as on one device; results equal up to the float rounding of the sum's order. `max_batch_size` must be
    a multiple of the axis' size (the default is rounded up to one).
    `sparse_rows`: DP-FEST on one embedding table (`jdp.clipping.sparse_rows.SparseRows`): each step selects the
    table's rows from noisy counts of the rows its units touch and noises and updates only those; the same
    event and σ (split between the selection and the gradient, `split_noise`), so the same ε.
    """
    if int(num_examples) < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    check_positive(batch_size, "batch_size")
    if batch_size > num_examples:
        raise ValueError(f"batch_size ({batch_size}) must be <= num_examples ({num_examples})")
    C = check_positive(l2_clip, "l2_clip")
    epsilon, delta = check_privacy(epsilon, delta, int(num_examples), unit=unit)  # δ < 1/n, ε <= MAX_EPSILON
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_batch_chunk(batch_chunk)
    q = float(batch_size) / int(num_examples)
    if steps is None:
        if epochs is None:
            raise ValueError("give steps or epochs")
        steps = int(math.ceil(check_positive(epochs, "epochs") / q))
    if int(steps) < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if sparse_rows is not None and not isinstance(sparse_rows, SparseRows):
        raise ValueError(f"sparse_rows must be a jdp.clipping.sparse_rows.SparseRows, got {type(sparse_rows).__name__}")
    if (epsilon is None) == (noise_multiplier is None):
        raise ValueError("give exactly one of epsilon (calibrates the noise) or noise_multiplier")
    if epsilon is not None:
        noise_multiplier = calibrate_noise_multiplier(epsilon, delta, q, int(steps), accountant)
    check_positive(noise_multiplier, "noise_multiplier")
    check_mesh(mesh, data_axis)
    n_dev = 1 if mesh is None else int(mesh.shape[data_axis])
    mb = (default_max_batch_size(int(num_examples), q, multiple=math.lcm(8, n_dev)) if max_batch_size is None
          else int(max_batch_size))
    if mb < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    check_mesh(mesh, data_axis, mb)
    return DPSGD(loss_fn, optimizer, int(num_examples), q, int(steps), C, float(noise_multiplier), delta, mb,
                 method, bool(normalize), accountant, unit, batch_chunk, mesh, data_axis, sparse_rows)


__all__ = ["DPAggregateState", "DPSGD", "DPSGDState", "DP_FEST_RELEASE", "DP_SGD_RELEASE", "calibrate_noise_multiplier",
           "clipped_accumulate", "default_max_batch_size", "dp_aggregate", "dp_sgd", "dp_sgd_event", "dp_sgd_release",
           "poisson_indices", "poisson_keep", "poisson_sample"]
