"""DP-SGD training of sequential recommenders (DPFormer and baselines), on the library's one DP-SGD path.

Privacy unit: one user = one training sequence; neighbouring relation: add/remove one user's
sequence. Each step is `jdp.clipping.dp_sgd`'s: a Poisson sample (every user independently with
probability q = B/N, no truncation), the sum of per-user clipped gradients from `jdp.clipping.clipped_grad`
(norm over all parameters jointly, clip C; Phantom clipping for the tied input/output embedding),
N(0, σ²C²I) added and the sum divided by the expected batch size B (`dp_aggregate`), then Adam(W) with
linear warm-up + linear decay. Released: T subsampled Gaussian steps and, for DPFormer without public
counts, one Gaussian item histogram (for Re-Attention's p_i); σ is calibrated so the composition of
both meets (ε, δ) under dp_accounting's RDP accountant.

`epsilon=None` is the explicitly NON-PRIVATE reference (no clipping, no noise, no report).

Here: `train` and its loop. What the loop runs with is fixed before it, in the neighbouring modules: `config`
(TrainConfig), `releases` (sampling plan, releases, σ, report), `prepare` (model, starting parameters, step
functions, evaluation), `batches` (a step's length chunks and negatives), `item_table`, `nonprivate` (the
reference step) and `checkpoint`; their public names are importable from here too.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jdp import accounting
from jdp.clipping.dp_sgd import dp_sgd_event, poisson_indices
from jdp.seqrec.batches import check_negatives, length_chunks, negative_probs, sample_negatives, step_batches
from jdp.seqrec.checkpoint import RESUMABLE_FIELDS, check_resumable, resume, run_record, write_checkpoint
from jdp.seqrec.config import (DEFAULT_WINDOWS, DROPOUT, ITEM_INIT_EPSILON_SHARE, ITEM_INITS, NEGATIVE_SAMPLERS,
                                PRIOR_DROPOUT, PRIOR_EPSILON_SHARE, TrainConfig)
from jdp.seqrec.data import SeqData
from jdp.seqrec.evaluate import baseline_metrics, evaluate
from jdp.seqrec.item_table import (freeze_item_rows, freeze_item_table_loss, frozen_item_rows, start_from_item_table,
                                   zero_item_rows)
from jdp.seqrec.nonprivate import NONPRIVATE_CPU_ROWS
from jdp.seqrec.prepare import Run, lr_schedule, prepare
from jdp.seqrec.releases import DP_FEST_STEP, DP_SGD_STEP, PrivacySetup, partial_report, privacy_setup, sampling_plan
from jdp.validation import check_positive


@dataclasses.dataclass
class TrainResult:
    params: Any
    metrics: dict
    privacy: accounting.PrivacyReport | None
    noise_multiplier: float
    steps: int
    history: list
    timings: dict
    reatt: dict | None
    item_counts_released: np.ndarray | None
    # what users get without the model, on the same targets (`evaluate.baseline_metrics`)
    baselines: dict = dataclasses.field(default_factory=dict)
    # PRIVATE diagnostics of the steps this call ran, computed from the private data without noise and not covered
    # by the report (never printed by default): `num_nonfinite` = sampled users dropped from their step's sum
    # because their loss or gradient was not finite (they contribute nothing; training goes on regardless)
    private_diagnostics: dict = dataclasses.field(default_factory=dict)


def train(data: SeqData, cfg: TrainConfig, key: jax.Array, public_item_counts: np.ndarray | None = None,
          checkpoint: str | pathlib.Path | None = None, checkpoint_every: int | None = None,
          progress: bool = True, evaluate_test: bool = True, max_steps: int | None = None,
          max_seconds: float | None = None, initial_params: Any | None = None,
          show_private_diagnostics: bool = False, time_budget_s: float | None = None) -> TrainResult:
    """Trains cfg.model with DP-SGD at (cfg.epsilon, cfg.delta) and evaluates on valid/test.

    Unit: user (one sequence); relation: add/remove one user. public_item_counts: caller-DECLARED
    public per-item sequence counts [M+1] for Re-Attention (then no histogram is released); otherwise
    DPFormer releases a Gaussian histogram accounted in the report. Exact counts are never used.
    `checkpoint`: a file written every `checkpoint_every` steps (default: every epoch) and at the end,
    and resumed from when it exists (same data, config and key: the run continues as if never stopped; checked
    against the run record written beside it, `run_record`, before any work: ValueError otherwise).
    `max_steps`: stop after this many steps of this call (the noise was calibrated for all `steps`; the
    report covers the steps that ran, see below); resume later from the checkpoint.
    `max_seconds`: stop after the first step that ends this many seconds after the call began (same
    meaning as `max_steps`: a checkpoint is written, the model is evaluated where it stopped).
    `time_budget_s` (`jdp seqrec --max-minutes`): stop at the last epoch boundary before this many seconds
    after the call began, i.e. at an epoch's end when the next epoch (this call's median step time after
    its first step x steps per epoch) would not end within it; after the step that crosses it if the
    estimate was wrong. A checkpoint is written and `timings["stopped"]` says where and why. Time is a public
    quantity: stopping on it reads no data.
    A run stopped before its planned steps (any of the three) reports the epsilon of the steps that ran
    (`partial_report`; the noise was calibrated for all of them, so continuing it spends up to the plan).
    `initial_params`: parameters to start from instead of the model's random initialisation (checked against
    its structure). Their values must be public or post-processing of releases in this run's report (e.g.
    `data.vocab_releases`): the report does not cover anything else they were computed from.

    Every planned step runs whatever the data holds: no property of the private data stops, branches or fails
    the loop. A sampled user whose loss or gradient is not finite contributes nothing to that step's sum (the
    sensitivity bound holds) and is counted in `TrainResult.private_diagnostics["num_nonfinite"]` and in the
    history's epoch entries. The history's `train_loss` and `num_nonfinite` and the sample sizes are PRIVATE
    diagnostics (no noise, not in the report): `progress` shows them only with `show_private_diagnostics=True`.
    """
    cfg.validate()
    if max_seconds is not None:
        check_positive(max_seconds, "max_seconds")
    if time_budget_s is not None:
        check_positive(time_budget_s, "time_budget_s")
    t_start = time.perf_counter()
    plan = sampling_plan(data, cfg)
    ckpt = pathlib.Path(checkpoint) if checkpoint else None
    record = run_record(data, cfg, key, public_item_counts) if ckpt is not None else None
    resuming = ckpt is not None and ckpt.exists()
    if resuming:  # before any work or release
        check_resumable(ckpt, record)
    run = prepare(data, cfg, plan, key, public_item_counts, resuming, initial_params, evaluate_test)
    start, history = 0, []
    if resuming:
        run.state, start, history = resume(ckpt, run.state, run.k_noise if run.private else None)
    stop = run.steps if max_steps is None else min(run.steps, start + int(max_steps))
    loop = _Loop(start, stop, history, per_epoch=max(1, int(math.ceil(run.N / cfg.batch_size))))
    loop.checkpoint_every = loop.per_epoch if checkpoint_every is None else int(checkpoint_every)
    if run.first_step_ready is None:  # else once the first step is compiled (two cores: it comes first)
        run.precompile_evaluation()
    _train_steps(run, loop, t_start, ckpt, record, progress, show_private_diagnostics, max_seconds, time_budget_s)
    run.pool.shutdown(wait=True)  # the evaluation's compilations
    return _evaluated_result(run, loop, ckpt, public_item_counts, evaluate_test, t_start)


@dataclasses.dataclass
class _Loop:
    """Where `train`'s loop stands: steps [start, stop) of this call, the history, the private diagnostics."""
    start: int
    stop: int
    history: list
    per_epoch: int
    checkpoint_every: int = 0
    t_train: float = 0.0
    epoch_loss: float = 0.0
    epoch_count: int = 0
    epoch_nonfinite: int = 0         # private diagnostics: users dropped for a non-finite loss/gradient
    total_nonfinite: int = 0
    stopped: dict | None = None      # why and where a run ended before its planned steps (public: steps and time)
    step_s: list = dataclasses.field(default_factory=list)            # per-step time
    shapes_seen: set = dataclasses.field(default_factory=set)
    step_new_shapes: list = dataclasses.field(default_factory=list)   # steps that compiled a new chunk shape


def _one_step(run: Run, loop: _Loop, step: int, zero) -> tuple:
    """DP-SGD step `step`: its Poisson sample laid out by length, each chunk's clipped sum accumulated, then the noisy
    update. Returns (sample size, loss sum, count, non-finite count): private diagnostics."""
    cfg, data = run.cfg, run.data
    k_step = jax.random.fold_in(run.k_sample, step)
    idx = poisson_indices(k_step, run.N, run.q)  # the rule of every jdp DP-SGD step (same for the reference)
    idx = idx[idx < data.n_users]  # ids of the declared population without data contribute nothing
    kd = jax.random.fold_in(run.k_dropout, step)
    acc, loss_sum, count, nonfinite = zero, 0.0, 0, 0
    negs = (jnp.asarray(sample_negatives(jax.random.fold_in(run.k_neg, step), data.n_items, cfg.negatives,
                                         run.neg_probs)) if cfg.negatives else None)
    chunks = step_batches(data, idx, run.windows, cfg.chunk_rows, kd, negs)
    if run.first_step_ready is not None:  # calling `accumulate` while it compiles would compile it twice
        run.first_step_ready.result()
        run.first_step_ready = None
        run.precompile_evaluation()
    new = {(w, int(mask.size)) for w, _, mask in chunks} - loop.shapes_seen
    loop.shapes_seen |= new
    loop.step_new_shapes.append(len(new))
    for _, batch, mask in chunks:
        acc, sums = run.accumulate(run.state.params, acc, batch, mask, run.reatt)
        loss_sum, count = loss_sum + sums["loss_sum"], count + sums["count"]
        nonfinite = nonfinite + sums["num_nonfinite"]
    if run.apply_ready is not None:  # compiled beside the first step (calling it meanwhile would compile it twice)
        run.apply_ready.result()
        run.apply_ready = None
    run.state = run.apply(run.state, acc)
    return idx.size, loss_sum, count, nonfinite


def _history_entry(run: Run, loop: _Loop, done: int) -> dict | None:
    """The history's entry after step `done`: at an epoch's end (train_loss, num_nonfinite: private; ε spent) and
    at a validation point."""
    cfg, N = run.cfg, run.N
    entry = None
    if done % loop.per_epoch == 0 or done == run.steps:
        entry = {"step": done, "epoch": done * cfg.batch_size / N,  # train_loss, num_nonfinite: private
                 "train_loss": loop.epoch_loss / max(loop.epoch_count, 1), "num_nonfinite": loop.epoch_nonfinite}
        if run.private:
            entry["epsilon_spent"] = run.epsilon_after(done)
        loop.epoch_loss, loop.epoch_count, loop.epoch_nonfinite = 0.0, 0, 0
    eval_every = (max(1, int(round(cfg.eval_every_epochs * loop.per_epoch))) if cfg.eval_every_epochs > 0
                  else 0)
    if eval_every and done % eval_every == 0 and done < run.steps:
        m = evaluate(run.model, run.state.params, run.data.valid_input, run.data.valid_target,
                     chunk=cfg.eval_chunk, rank_fn=run.rank_fn, length_buckets=run.eval_windows)
        entry = {**(entry or {"step": done, "epoch": done * cfg.batch_size / N}),
                 "ndcg_at_10_valid": m["ndcg"], "hit_at_10_valid": m["hit"]}
    return entry


def _train_steps(run: Run, loop: _Loop, t_start: float, ckpt, record, progress: bool,
                 show_private_diagnostics: bool, max_seconds, time_budget_s) -> None:
    """`train`'s loop: every step of [loop.start, loop.stop) unless time runs out (public), checkpoints."""
    private_keys = ("train_loss", "num_nonfinite")  # history entries shown only with show_private_diagnostics
    zero = run.zeros(run.state.params)
    it = tqdm(range(loop.start, loop.stop), desc=f"{run.cfg.model} eps={run.cfg.epsilon}", disable=not progress,
              initial=loop.start, total=run.steps)
    for step in it:
        t0 = time.perf_counter()
        n_sampled, loss_sum, count, nonfinite = _one_step(run, loop, step, zero)
        # such users contributed nothing (the bound holds); the run goes on: a private count, never a branch
        loop.epoch_nonfinite += int(nonfinite)
        loop.total_nonfinite += int(nonfinite)
        loop.epoch_loss, loop.epoch_count = loop.epoch_loss + float(loss_sum), loop.epoch_count + int(count)
        loop.step_s.append(time.perf_counter() - t0)
        loop.t_train += loop.step_s[-1]
        if show_private_diagnostics:  # the sample's loss and size are private: opt-in only
            it.set_postfix(loss=f"{float(loss_sum) / max(int(count), 1):.3f}", batch=n_sampled,
                           nonfinite=int(nonfinite))
        done = step + 1
        entry = _history_entry(run, loop, done)
        if entry is not None:
            loop.history.append(entry)
            if progress:
                it.write("  ".join(_progress_item(k, v) for k, v in entry.items()
                                   if show_private_diagnostics or k not in private_keys))
        out_of_time = _out_of_time(loop, done, time.perf_counter() - t_start, max_seconds, time_budget_s)
        if ckpt is not None and (done % loop.checkpoint_every == 0 or done == loop.stop or out_of_time):
            write_checkpoint(ckpt, run.state, loop.history, record)
        if out_of_time:
            loop.stop = done
            break


def _out_of_time(loop: _Loop, done: int, elapsed: float, max_seconds, time_budget_s) -> bool:
    """Whether the loop stops after step `done` for time (public: never the data); sets loop.stopped."""
    out_of_time = max_seconds is not None and elapsed >= max_seconds
    if time_budget_s is not None and done < loop.stop and not out_of_time:
        if budget_says_stop(elapsed, done, loop.per_epoch, loop.step_s, time_budget_s):
            out_of_time = True
            loop.stopped = {"reason": "time budget", "at_epoch_boundary": done % loop.per_epoch == 0,
                            "budget_s": time_budget_s, "elapsed_s": elapsed}
    if out_of_time and loop.stopped is None:
        loop.stopped = {"reason": "time limit (max_seconds)", "at_epoch_boundary": done % loop.per_epoch == 0}
    return out_of_time


def _evaluated_result(run: Run, loop: _Loop, ckpt, public_item_counts, evaluate_test: bool, t_start: float
                      ) -> TrainResult:
    """The TrainResult after the loop: the report of the steps that ran, the metrics beside the baselines."""
    cfg, N, steps, report = run.cfg, run.N, run.steps, run.report
    params, steps_done = run.state.params, int(run.state.step)
    stopped = loop.stopped
    if steps_done < steps:
        stopped = {**(stopped or {"reason": "max_steps", "at_epoch_boundary": steps_done % loop.per_epoch == 0}),
                   "step": steps_done, "planned_steps": steps, "epoch": steps_done * cfg.batch_size / N,
                   "checkpoint": None if ckpt is None else str(ckpt)}
        if report is not None:  # the release is the model after the steps that ran: their epsilon, not the plan's
            report = partial_report(report, steps_done, steps)
    t0 = time.perf_counter()
    metrics, baselines = _metrics(run, params, public_item_counts, evaluate_test)
    t_eval = time.perf_counter() - t0
    timings = {"train_s": loop.t_train, "eval_s": t_eval, "total_s": time.perf_counter() - t_start,
               "steps_run": loop.stop - loop.start, "steps_done": steps_done,
               "epochs_done": steps_done * cfg.batch_size / N,
               "s_per_step": loop.t_train / max(1, loop.stop - loop.start), "step_s": loop.step_s,
               "step_new_shapes": loop.step_new_shapes,
               "complete": steps_done == steps, **({"stopped": stopped} if stopped is not None else {})}
    return TrainResult(params, metrics, report, float(run.sigma), steps, loop.history, timings, run.reatt,
                       run.counts_rel, baselines, private_diagnostics={"num_nonfinite": loop.total_nonfinite})


def _metrics(run: Run, params, public_item_counts, evaluate_test: bool) -> tuple[dict, dict]:
    """(metrics, baselines): NDCG / HIT at 10 on the validation (and test) users, and what users get without the
    model on the same targets."""
    cfg, data = run.cfg, run.data
    mv = evaluate(run.model, params, data.valid_input, data.valid_target, chunk=cfg.eval_chunk, rank_fn=run.rank_fn,
                  length_buckets=run.eval_windows)
    metrics = {"ndcg_at_10_valid": mv["ndcg"], "hit_at_10_valid": mv["hit"], "n_valid_users": mv["n_users"]}
    if evaluate_test:
        mt = evaluate(run.model, params, data.test_input, data.test_target, chunk=cfg.eval_chunk,
                      rank_fn=run.rank_fn, length_buckets=run.eval_windows)
        metrics.update({"ndcg_at_10_test": mt["ndcg"], "hit_at_10_test": mt["hit"], "n_test_users": mt["n_users"]})
        # the other protocol too (papers differ on it): history items removed from / kept in the ranking
        other = "history_unmasked" if cfg.mask_history else "history_masked"
        metrics.update({f"ndcg_at_10_test_{other}": mt["other"]["ndcg"],
                        f"hit_at_10_test_{other}": mt["other"]["hit"]})
    # zero cost (each user's own history) and, from public or already released counts, popularity: DPFormer's
    # histogram, else the item-table start's own popularity release (post-processing either way)
    popular = public_item_counts
    if popular is None and run.private:
        popular = (run.counts_rel if run.counts_rel is not None
                   else run.item_start.counts if run.item_start is not None else None)
    baselines = baseline_metrics(data, popular, splits=("valid", "test") if evaluate_test else ("valid",))
    return metrics, baselines


def _progress_item(key: str, value) -> str:
    """One item of a progress line: NDCG / HIT in percent (the unit every printed metric of jdp seqrec uses)."""
    if key.startswith(("ndcg", "hit")) and isinstance(value, float):
        return f"{key.replace('_at_10', '@10')} {100 * value:.2f}%"
    return f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"


def budget_says_stop(elapsed: float, done: int, per_epoch: int, step_s: list[float], budget_s: float) -> bool:
    """Whether a run with a time budget stops after step `done`: once the budget is spent, and at an epoch's end
    when the next epoch, estimated from the median time of this call's steps after its first (which compiles),
    would end past it. Reads only time and step counts (public)."""
    if elapsed >= budget_s:
        return True
    if done % per_epoch or not step_s:
        return False
    typical = float(np.median(step_s[1:] if len(step_s) > 1 else step_s))
    return elapsed + typical * per_epoch > budget_s


# `train`'s own names, then those of the pieces it runs with (their homes: the modules above), importable from here
__all__ = ["TrainResult", "budget_says_stop", "train",
           "DEFAULT_WINDOWS", "DP_FEST_STEP", "DP_SGD_STEP", "DROPOUT", "ITEM_INITS", "ITEM_INIT_EPSILON_SHARE",
           "NEGATIVE_SAMPLERS", "NONPRIVATE_CPU_ROWS", "PRIOR_DROPOUT", "PRIOR_EPSILON_SHARE",
           "PrivacySetup", "RESUMABLE_FIELDS",
           "TrainConfig", "check_negatives", "check_resumable", "dp_sgd_event", "freeze_item_rows",
           "freeze_item_table_loss", "frozen_item_rows", "length_chunks", "lr_schedule", "negative_probs",
           "partial_report", "privacy_setup", "run_record", "sample_negatives", "sampling_plan",
           "start_from_item_table", "step_batches", "zero_item_rows"]
