"""Acceptance orderings on the synthetic scenarios at ε ∈ {0.1, 1} (small size, exact probabilities)."""
import numpy as np
import pytest

from jdp.selection import scenarios as SC

EPS = (0.1, 1.0)
MECHS = ("uniform", "rnm-exp", "gem", "mgem", "rs-geometric", "combined-gem")


def _curves(scenario, k=24, trials=6, seed=0):
    q, d = scenario.draw(np.random.default_rng(seed), trials, k)
    assert q.shape == d.shape == (trials, k) and np.all(d > 0)
    return SC.mse_curves(q, d, MECHS, EPS)


def test_positive_correlation_ordering():
    c = _curves(SC.bimodal("positive"))
    for i in range(len(EPS)):
        assert c["mgem"][i] < c["rnm-exp"][i] and c["rs-geometric"][i] < c["rnm-exp"][i]
    assert c["gem"][0] > c["uniform"][0]  # GEM worse than uniform at small ε


def test_negative_correlation_ordering():
    c = _curves(SC.bimodal("negative"))
    for i in range(len(EPS)):
        assert c["gem"][i] < c["rnm-exp"][i] and c["gem"][i] < c["mgem"][i]


@pytest.mark.parametrize("seed", [1, 2])
def test_polarised_population_combined_gem_beats_gem_and_mgem(seed):
    c = _curves(SC.polarised("strong"), trials=8, seed=seed)
    for i in range(len(EPS)):
        assert c["combined-gem"][i] < min(c["gem"][i], c["mgem"][i])


def test_generators_have_the_stated_correlation():
    import jax.numpy as jnp
    from jdp.selection import correlation as C
    rng = np.random.default_rng(3)
    for sc, sign in [(SC.smooth("positive"), 1), (SC.smooth("negative"), -1), (SC.copula(0.9), 1),
                     (SC.copula(-0.9), -1), (SC.bimodal("positive"), 1), (SC.bimodal("negative"), -1)]:
        q, d = sc.draw(rng, 20, 50)
        rho = np.asarray(C.spearman(jnp.asarray(q), jnp.asarray(d)))
        assert np.all(np.sign(rho) == sign), sc.name
    q, d = SC.smooth("none").draw(rng, 50, 50)
    assert abs(float(np.mean(np.asarray(C.spearman(q, d))))) < 0.1
