"""Names changed by issue 71 item 4 ("one name per concept": the per-unit L2 clip bound is `l2_clip` in every API,
`--l2-clip` on every command line). Each old name still works for one release, with a DeprecationWarning (on the
command line: a note on stderr) that names the new one; giving both names is refused."""
import warnings

import jax
import jax.numpy as jnp
import pytest

from jdp import meta as M
from jdp.altmin import AltMinConfig
from jdp.cli import main
from jdp.meta import privacy
from jdp.multitask.noisy_gd import NoisyGDConfig
from jdp.validation import renamed_keywords


def test_altmin_config_sgd_clip_is_l2_clip():
    with pytest.warns(DeprecationWarning, match="sgd_clip= is deprecated.*use l2_clip="):
        cfg = AltMinConfig(method="ada-dpsgd", sgd_clip=2.0)
    assert cfg == AltMinConfig(method="ada-dpsgd", l2_clip=2.0)
    with pytest.warns(DeprecationWarning, match=r"\.sgd_clip is deprecated.*use \.l2_clip"):
        assert cfg.sgd_clip == 2.0
    with pytest.raises(ValueError, match="pass l2_clip= only"):
        AltMinConfig(sgd_clip=2.0, l2_clip=2.0)
    with warnings.catch_warnings():  # the new name and dataclasses.replace warn of nothing
        warnings.simplefilter("error")
        assert AltMinConfig(l2_clip=3.0).resolve().l2_clip == 3.0
    with pytest.raises(AttributeError, match="no attribute 'sgd_clipp'"):
        cfg.sgd_clipp  # noqa: B018  (other missing attributes stay missing)


def test_noisy_gd_config_clip_norm_is_l2_clip():
    with pytest.warns(DeprecationWarning, match="clip_norm= is deprecated.*use l2_clip="):
        cfg = NoisyGDConfig(clip_norm=0.5, noise_multiplier=1.0, steps=2, learning_rate=0.1)
    assert cfg == NoisyGDConfig(0.5, 1.0, 2, 0.1) == NoisyGDConfig(l2_clip=0.5, noise_multiplier=1.0, steps=2,
                                                                   learning_rate=0.1)
    with pytest.warns(DeprecationWarning, match=r"\.clip_norm is deprecated"):
        assert cfg.clip_norm == 0.5
    with pytest.raises(ValueError, match="pass l2_clip= only"):
        NoisyGDConfig(clip_norm=0.5, l2_clip=0.5, noise_multiplier=1.0, steps=2, learning_rate=0.1)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="l2_clip must be"):
        NoisyGDConfig(clip_norm=-1.0, noise_multiplier=1.0, steps=2, learning_rate=0.1)


def test_the_warning_points_at_the_caller():
    @renamed_keywords(old="new")
    def f(new):
        return new
    with pytest.warns(DeprecationWarning) as record:
        assert f(old=3) == 3
        cfg = AltMinConfig(sgd_clip=2.0)
        assert cfg.sgd_clip == 2.0
    assert [r.filename for r in record] == [__file__] * 3


TASKS = M.single_cluster_regression(jax.random.PRNGKey(0), 12, n_points=4, dim=3)[0]
H0 = jnp.zeros(3)
COMMON = dict(steps=2, batch_size=2, meta_lr=0.5)


@pytest.mark.parametrize("call", [
    lambda **kw: M.meta_nsgd(jax.random.PRNGKey(1), TASKS, M.RidgeLearner(lam=0.8), H0, epsilon=1.0, delta=1e-5,
                             **COMMON, **kw),
    lambda **kw: M.private_clustering_meta(jax.random.PRNGKey(1), TASKS, M.RidgeLearner(lam=0.8), 2, template=H0,
                                           epsilon=1.0, delta=1e-5, **COMMON, **kw),
    lambda **kw: M.dp_ftmrl(jax.random.PRNGKey(1), TASKS, M.RidgeLearner(lam=0.8), H0, epsilon=1.0, delta=1e-5,
                            meta_lr=0.5, **kw),
    lambda **kw: M.meta_sgd_nonprivate(jax.random.PRNGKey(1), TASKS, M.RidgeLearner(lam=0.8), template=H0,
                                       **COMMON, **kw),
    lambda **kw: privacy.add_release(privacy.new_report(1e-5, "poisson"), "r", "poisson", 1.0, n_tasks=12,
                                     batch_size=2, steps=2, **kw),
], ids=["meta_nsgd", "private_clustering_meta", "dp_ftmrl", "meta_sgd_nonprivate", "privacy.add_release"])
def test_meta_clip_is_l2_clip(call):
    """The old keyword reaches the new argument: its value is validated under the new name (before any work)."""
    with pytest.warns(DeprecationWarning, match="clip= is deprecated.*use l2_clip="), \
            pytest.raises(ValueError, match="l2_clip must be"):
        call(clip=-1.0)
    with pytest.raises(ValueError, match="pass l2_clip= only"):
        call(clip=1.0, l2_clip=1.0)


def test_meta_accounting_clip_is_l2_clip():
    counts = dict(n_tasks=12, batch_size=2, steps=2)
    with pytest.warns(DeprecationWarning, match="clip= is deprecated"):
        old = privacy.epsilon_under("poisson", "add_or_remove_one", 2.0, delta=1e-5, clip=1.0, **counts)
    assert old == privacy.epsilon_under("poisson", "add_or_remove_one", 2.0, delta=1e-5, l2_clip=1.0, **counts)
    with pytest.warns(DeprecationWarning, match="clip= is deprecated"):
        old = privacy.restatements("poisson", 2.0, clip=1.0, **counts)
    assert old == privacy.restatements("poisson", 2.0, l2_clip=1.0, **counts)
    spec = M.engine.FlatSpec.of(H0)
    h = jnp.zeros((2, 3))
    for f in (M.update_sensitivity, M.clustering.routed_update):
        with pytest.warns(DeprecationWarning, match="clip= is deprecated"):
            old = f(M.RidgeLearner(lam=0.8), spec, h, TASKS, jax.random.PRNGKey(2), clip=0.5)
        assert jnp.array_equal(old, f(M.RidgeLearner(lam=0.8), spec, h, TASKS, jax.random.PRNGKey(2), l2_clip=0.5))


@pytest.mark.parametrize("command", [["meta", "--seed", "1"], ["seqrec", "--data", "synthetic"]])
def test_clip_flag_is_l2_clip(command, capsys):
    """`--clip` still sets the clip bound (a bad value is refused naming the flag's new name), with a deprecation
    note on stderr; --help shows only `--l2-clip`."""
    assert main([*command, "--clip", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--clip is deprecated and will be removed in the next release; use --l2-clip" in err
    assert "--l2-clip must be" in err
    with pytest.raises(SystemExit):
        main([command[0], "--help"])
    out = capsys.readouterr().out
    assert "--l2-clip" in out and "--clip " not in out
