"""Meta-learning privacy (audit item 8): every method's ε stated under add/remove AND replace-one."""
import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from dp_accounting import dp_event as dpe
from dp_accounting import NeighboringRelation as Rel
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from jdp import accounting
from jdp import meta as M

ROOT = pathlib.Path(__file__).resolve().parents[2]
KEY = jax.random.PRNGKey(0)
DIM, K, B, T, C, DELTA = 4, 60, 6, 4, 1.5, 1e-5
TASKS = M.single_cluster_regression(KEY, K, n_points=6, dim=DIM, mean=3.0)[0]
RIDGE = M.RidgeLearner(lam=0.8)
Z = 3.0  # noise multiplier under each method's native relation (explicit: no calibration, fast)


def _rdp(event, relation, orders=accounting.DEFAULT_RDP_ORDERS):
    a = rdp_privacy_accountant.RdpAccountant(list(orders), relation)
    a.compose(event)
    return a.get_epsilon(DELTA)


@functools.lru_cache(maxsize=None)  # meta-NSGD and clustering share the Poisson events
def _pld(event, relation, interval=1e-4):
    a = pld_privacy_accountant.PLDAccountant(relation, value_discretization_interval=interval)
    a.compose(event)
    return a.get_epsilon(DELTA)


def _run(index):
    common = dict(epsilon=None, noise_multiplier=Z, delta=DELTA, steps=T, batch_size=B, meta_lr=0.5, l2_clip=C)
    h0 = jnp.zeros(DIM)
    if index == 0:
        return "meta-NSGD poisson", "poisson", M.meta_nsgd(KEY, TASKS, RIDGE, h0, sampling="poisson", **common)
    if index == 1:
        return "meta-NSGD fixed", "fixed", M.meta_nsgd(KEY, TASKS, RIDGE, h0, sampling="fixed", **common)
    if index == 2:
        return "clustering poisson", "poisson", M.private_clustering_meta(KEY, TASKS, RIDGE, 2, template=h0, **common)
    return "DP-FTMRL", "tree", M.dp_ftmrl(KEY, TASKS, RIDGE, h0, epsilon=None, noise_multiplier=Z, delta=DELTA,
                                          meta_lr=0.5, l2_clip=C, batch_size=B)


@pytest.mark.parametrize("index", range(4))
def test_report_epsilon_under_both_relations_matches_dp_accounting(index):
    """Audit item 8: each meta method's report gives ε under add/remove one task (sensitivity C) and under
    replace one task (sensitivity 2C); both equal an independent dp_accounting computation from the run's
    noise std, and the one under the run's native relation equals the report's ε."""
    name, mech, res = _run(index)
    std = res.noise_std
    by = res.report.epsilon_by_relation()
    if mech == "poisson":
        add = _rdp(dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(B / K, dpe.GaussianDpEvent(std / C)), T),
                   Rel.ADD_OR_REMOVE_ONE)
        # dp_accounting's REPLACE_ONE pair is shifted by ±sensitivity: sensitivity C puts the outputs 2C apart
        rep = _pld(dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(B / K, dpe.GaussianDpEvent(std / C)), T),
                   Rel.REPLACE_ONE)
        # cross-check that convention: without sampling it is the Gaussian at twice the sensitivity
        assert _pld(dpe.GaussianDpEvent(std / C), Rel.REPLACE_ONE) == pytest.approx(
            _pld(dpe.GaussianDpEvent(std / (2 * C)), Rel.ADD_OR_REMOVE_ONE), rel=1e-6)
        native = add
    elif mech == "fixed":
        add = None  # m of K without replacement needs K fixed: add/remove is not defined
        rep = _rdp(dpe.SelfComposedDpEvent(dpe.SampledWithoutReplacementDpEvent(K, B, dpe.GaussianDpEvent(
            std / (2 * C))), T), Rel.REPLACE_ONE, accounting.REPLACE_ONE_RDP_ORDERS)
        native = rep
    else:
        steps = -(-K // B)
        add = _rdp(dpe.SingleEpochTreeAggregationDpEvent(std / C, steps), Rel.REPLACE_SPECIAL)
        rep = _rdp(dpe.SingleEpochTreeAggregationDpEvent(std / (2 * C), steps), Rel.REPLACE_SPECIAL)
        native = add
    assert native == pytest.approx(res.report.epsilon(), rel=1e-6), name
    if add is None:
        assert by[accounting.ADD_OR_REMOVE_ONE] is None
    else:
        assert by[accounting.ADD_OR_REMOVE_ONE] == pytest.approx(add, rel=2e-2), name
    assert by[accounting.REPLACE_ONE] == pytest.approx(rep, rel=2e-2), name
    if mech == "tree":  # the same noise protects a replacement (2C) less than an addition (C)
        assert by[accounting.REPLACE_ONE] > 1.5 * by[accounting.ADD_OR_REMOVE_ONE], name
    if mech == "poisson":  # same comparison within one accountant (PLD); the RDP cell is looser
        add_pld = _pld(dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(B / K, dpe.GaussianDpEvent(std / C)), T),
                       Rel.ADD_OR_REMOVE_ONE, 1e-3)
        assert rep > 1.15 * add_pld and add_pld <= add, name
        assert res.report.to_dict()["epsilon_by_relation_accountant"] == {"add_or_remove_one": "rdp",
                                                                           "replace_one": "pld"}
    d = res.report.to_dict()
    assert d["epsilon_by_relation"] == {rel.name.lower(): eps for rel, eps in by.items()}
    assert d["neighbouring_relation"] == res.report.relation.name.lower() == d["releases"][0]["relation"]
    assert "replace all data of one task by any other" in str(res.report)
    assert any("number of tasks K" in a for a in d["assumptions"])  # audit item 6: K is declared public


def test_tables_name_the_relation_of_every_epsilon():
    """Audit item 8: the meta benchmark page and docs/meta.md label each ε column with its neighbouring
    relation, with both add/remove and replace-one shown."""
    texts = {p: (ROOT / p).read_text() for p in ("benchmarks/meta/README.md", "docs/meta.md")}
    for path, text in texts.items():
        headers = [ln for ln in text.splitlines() if ln.startswith("|") and re.search(r"\| ε", ln)]
        assert headers, path
        for h in headers:
            assert re.search(r"ε[^|]*(add/remove|replace)", h), (path, h)
        assert any("add/remove" in h for h in headers) and any("replace-one" in h for h in headers), path


@pytest.mark.parametrize("scale", [1e19, 1e30])
def test_a_task_whose_data_overflows_the_learner_moves_the_step_sum_by_at_most_one_clip(scale):
    """Worst neighbour for every meta method (they share `engine.routed_sum`): an added task with FINITE data (it
    passes `make_taskset`) so large that its meta-gradient is huge (1e19) or overflows the ridge fit to inf/NaN
    (1e30). Its contribution to the summed update is at most C in norm, attained when it is merely huge; a
    non-finite one contributes 0: as NaN it made the released sum NaN, which revealed the task. The same task
    inside a whole meta-NSGD and DP-FTMRL run leaves the output finite."""
    from jdp.meta import engine
    bad = jax.tree.map(lambda a: a[:1] * scale, TASKS.data)
    with_bad = M.make_taskset(jax.tree.map(lambda a, b: jnp.concatenate([a, b]), TASKS.data, bad),
                              jnp.concatenate([TASKS.mask, TASKS.mask[:1]]))
    spec = engine.FlatSpec.of(jnp.zeros(DIM))
    h = jnp.stack([jnp.zeros(DIM), jnp.ones(DIM)])  # two meta-models, as private clustering routes
    keys = jax.random.split(KEY, K + 1)
    ones = jnp.ones(K + 1)
    s_with = engine.routed_sum(RIDGE, spec, h, with_bad.data, with_bad.mask, keys, ones, C)
    s_without = engine.routed_sum(RIDGE, spec, h, with_bad.data, with_bad.mask, keys, ones.at[K].set(0.0), C)
    assert bool(jnp.all(jnp.isfinite(s_with)))
    moved = float(jnp.linalg.norm(s_with - s_without))
    assert moved <= C * (1 + 1e-5)
    if scale == 1e19:
        assert moved == pytest.approx(C, rel=1e-4)  # the bound is attained
    common = dict(epsilon=None, noise_multiplier=Z, delta=DELTA, meta_lr=0.5, l2_clip=C, batch_size=B)
    for run in (M.meta_nsgd(KEY, with_bad, RIDGE, jnp.zeros(DIM), steps=T, **common),
                M.dp_ftmrl(KEY, with_bad, RIDGE, jnp.zeros(DIM), **common)):
        assert bool(jnp.all(jnp.isfinite(run.flat_last))) and bool(jnp.all(jnp.isfinite(run.flat_average)))
