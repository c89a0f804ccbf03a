"""One rule for the privacy parameters of every private entry point (`jdp.validation.check_privacy`): δ < 1/n of the
declared public number of units refused with the reason, ε ≤ 0 / NaN / inf and ε above MAX_EPSILON refused before
any work (so no calibration searches on absurd input), ε above LARGE_EPSILON accepted and warned in the report."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jdp import accounting
from jdp import meta as M
from jdp.altmin import AltMinConfig, fit
from jdp.cli import main
from jdp.cli_support import privacy_lines
from jdp.clipping import calibrate_noise_multiplier, dp_sgd
from jdp.data import Interactions
from jdp.multitask import noisy_gd, ssp
from jdp.seqrec import data as seqdata
from jdp.seqrec import train as seqtrain
from jdp.seqrec import transitions
from jdp.validation import LARGE_EPSILON, MAX_EPSILON, check_privacy, large_epsilon_warning

KEY = jax.random.key(0)


# ---------------------------------------------------------------------------------------------------
# The rule itself.
def test_check_privacy_refuses_delta_at_or_above_one_over_n_with_the_reason():
    with pytest.raises(ValueError, match=r"--delta = 0\.01 >= 1/n = 0\.01 for n = 100 protected users.*well below"):
        check_privacy(1.0, 0.01, 100, unit="user", delta_name="--delta")
    with pytest.warns(UserWarning, match="1/\\(10 n\\)"):
        assert check_privacy(1.0, 0.005, 100, unit="task") == (1.0, 0.005)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_privacy(2.0, 1e-5, 100) == (2.0, 1e-5)
        assert check_privacy(None, 1e-5, 100) == (None, 1e-5)  # a noise scale given instead of a target ε
    for bad_delta in (0.0, 1.0, float("nan"), -1e-5, "x"):
        with pytest.raises(ValueError, match="delta"):
            check_privacy(1.0, bad_delta, None)
    with pytest.raises(ValueError, match="protected users must be >= 1"):
        check_privacy(1.0, 1e-5, 0, unit="user")


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "one"])
def test_check_privacy_refuses_nonpositive_nan_and_infinite_epsilon(bad):
    with pytest.raises(ValueError, match="--epsilon"):
        check_privacy(bad, 1e-5, 10, epsilon_name="--epsilon")


def test_epsilon_beyond_the_maximum_is_refused_and_a_large_one_warned():
    with pytest.raises(ValueError, match="--epsilon = 1e\\+12 is above the largest target.*1000"):
        check_privacy(1e12, 1e-5, 10, epsilon_name="--epsilon")
    with pytest.raises(ValueError, match="above the largest target"):
        check_privacy(np.nextafter(MAX_EPSILON, np.inf), 1e-5, 10)
    with pytest.warns(UserWarning, match="above 30"):
        assert check_privacy(MAX_EPSILON, 1e-5, 10)[0] == MAX_EPSILON
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_privacy(LARGE_EPSILON, 1e-5, 10)  # at the threshold: no warning
    assert large_epsilon_warning(LARGE_EPSILON) is None and large_epsilon_warning(float("inf")) is None
    assert "above 30" in large_epsilon_warning(31.0, "user")


def test_report_above_large_epsilon_carries_a_warning():
    report = accounting.PrivacyReport(1e-5, unit="user").add_gaussian("sum", 1.0, 0.05)
    assert report.epsilon() > LARGE_EPSILON
    d = report.to_dict()
    assert len(d["warnings"]) == 1 and "above 30" in d["warnings"][0] and "one user" in d["warnings"][0]
    assert "WARNING: epsilon" in str(report)
    assert any(line.startswith("  WARNING: epsilon") for line in privacy_lines(d))  # the CLIs' printed report
    small = accounting.PrivacyReport(1e-5, unit="user").add_gaussian("sum", 1.0, 5.0)
    assert "warnings" not in small.to_dict() and "WARNING" not in str(small)


def _accountants_fail(monkeypatch):
    """Any composition in dp_accounting's accountants fails the test: what is refused is refused before them."""
    import dp_accounting

    def ran(*args, **kwargs):
        raise AssertionError("an accountant ran before the refusal")
    monkeypatch.setattr(dp_accounting.rdp.RdpAccountant, "compose", ran)
    monkeypatch.setattr(dp_accounting.pld.PLDAccountant, "compose", ran)


def test_absurd_epsilon_ends_calibration_at_once(monkeypatch):
    """ε = 1e12 in `jdp meta` spent a minute; every calibration now refuses it before the accountant runs
    (checked by making the accountants fail, not by a clock)."""
    tasks, learner = _tasks(), M.RidgeLearner(lam=0.8)
    with monkeypatch.context() as m:
        _accountants_fail(m)
        with pytest.raises(ValueError, match="above the largest target"):
            accounting.calibrate(lambda s: accounting.gaussian_event(s), 1e12, 1e-5)
        with pytest.raises(ValueError, match="above the largest target"):
            calibrate_noise_multiplier(1e12, 1e-5, 0.01, 100)
        with pytest.raises(ValueError, match="above the largest target"):
            M.meta_nsgd(KEY, tasks, learner, jnp.zeros(3), epsilon=1e12, delta=1e-5, steps=3,
                        batch_size=2, meta_lr=0.5, l2_clip=1.0)
    # the largest accepted target calibrates (to the bracket's floor at most)
    with pytest.warns(UserWarning, match="above 30"):
        sigma = calibrate_noise_multiplier(MAX_EPSILON, 1e-5, 0.01, 100)
    assert 1e-2 <= sigma < 1.0


# ---------------------------------------------------------------------------------------------------
# Every private entry point: δ >= 1/n refused (before any work), ε validated by the same rule.
def _ratings(n_users=40, n_items=12, seed=0):
    rng = np.random.default_rng(seed)
    user, item = np.nonzero(rng.random((n_users, n_items)) < 0.5)
    return Interactions(user.astype(np.int32), item.astype(np.int32),
                        rng.integers(1, 6, user.size).astype(np.float32), n_users, n_items)


def _tasks(k=10):
    return M.single_cluster_regression(jax.random.key(1), k, n_points=4, dim=3)[0]


def test_altmin_fit_refuses_delta_at_or_above_one_over_users():
    train = _ratings()  # 40 declared users: δ must stay below 0.025
    for method in ("ada-dpals", "dpsgd-uniform"):
        with pytest.raises(ValueError, match="delta = 0.5 >= 1/n = 0.025 for n = 40 protected users"):
            fit(train, AltMinConfig(method=method, epsilon=1.0, delta=0.5, show_progress=False), seed=0)
    with pytest.raises(ValueError, match="1/n"):
        fit(train, AltMinConfig(method="ada-dpals", epsilon=1.0, delta=0.025, show_progress=False), seed=0,
            tune="private")
    with pytest.raises(ValueError, match="above the largest target"):
        fit(train, AltMinConfig(method="ada-dpals", epsilon=1e12, show_progress=False), seed=0)


def test_meta_entry_points_refuse_delta_at_or_above_one_over_tasks():
    tasks, learner, h0 = _tasks(10), M.RidgeLearner(lam=0.8), jnp.zeros(3)
    common = dict(epsilon=1.0, delta=0.1, meta_lr=0.5, l2_clip=1.0)
    with pytest.raises(ValueError, match="n = 10 protected tasks"):
        M.meta_nsgd(KEY, tasks, learner, h0, steps=3, batch_size=2, **common)
    with pytest.raises(ValueError, match="n = 10 protected tasks"):
        M.meta_nsgd(KEY, tasks, learner, h0, steps=3, batch_size=2, calibration="theory", **common)
    with pytest.raises(ValueError, match="n = 10 protected tasks"):
        M.dp_ftmrl(KEY, tasks, learner, h0, **common)
    with pytest.raises(ValueError, match="n = 10 protected tasks"):
        M.private_clustering_meta(KEY, tasks, learner, 2, template=h0, steps=3, batch_size=2, **common)
    with pytest.raises(ValueError, match="n = 10 protected tasks"):  # a given noise multiplier: δ still checked
        M.meta_nsgd(KEY, tasks, learner, h0, steps=3, batch_size=2, noise_multiplier=1.0,
                    **{**common, "epsilon": None})


def test_seqrec_train_and_transitions_refuse_delta_at_or_above_one_over_users():
    rng = np.random.default_rng(0)
    d = seqdata.leave_last_out([rng.integers(1, 9, 5).astype(np.int32) for _ in range(10)], 8, 4)
    with pytest.raises(ValueError, match="n = 10 protected users"):
        seqtrain.train(d, seqtrain.TrainConfig(epsilon=1.0, delta=0.1, batch_size=4), KEY)
    with pytest.raises(ValueError, match="n = 50 protected users"):  # the declared public bound is the n
        seqtrain.train(d, seqtrain.TrainConfig(epsilon=1.0, delta=0.02, batch_size=4, n_users_public=50), KEY)
    with pytest.raises(ValueError, match="above the largest target"):
        seqtrain.train(d, seqtrain.TrainConfig(epsilon=1e12, delta=1e-5, batch_size=4), KEY)
    with pytest.raises(ValueError, match="n = 10 protected users"):
        transitions.fit(d, 1.0, 0.1, 4, KEY)


def test_dp_sgd_refuses_delta_at_or_above_one_over_examples():
    common = dict(num_examples=20, batch_size=4, l2_clip=1.0, steps=2)
    with pytest.raises(ValueError, match="n = 20 protected examples"):
        dp_sgd(lambda p, b: b, optax.sgd(0.1), delta=0.05, epsilon=1.0, **common)
    with pytest.raises(ValueError, match="n = 20 protected users"):
        dp_sgd(lambda p, b: b, optax.sgd(0.1), delta=0.05, noise_multiplier=1.0, unit="user", **common)
    with pytest.raises(ValueError, match="above the largest target"):
        dp_sgd(lambda p, b: b, optax.sgd(0.1), delta=1e-5, epsilon=1e12, **common)


def test_multitask_ssp_and_noisy_gd_refuse_a_report_delta_at_or_above_one_over_users():
    rng = np.random.default_rng(0)
    n_users, n_tasks = 8, 3
    user, task = np.nonzero(rng.random((n_users, n_tasks)) < 0.7)
    x = rng.normal(size=(user.size, 2)).astype(np.float32)
    y = rng.normal(size=user.size).astype(np.float32)
    w = np.full(user.size, 0.1, np.float32)
    with pytest.raises(ValueError, match="report.delta = 0.2 >= 1/n = 0.125 for n = 8 protected users"):
        ssp.task_weighted_ssp(KEY, task, user, x, y, w, n_tasks, n_users, beta=1.0, clip_x=1.0, clip_y=1.0,
                              noise_multiplier=1.0, lam=1.0, report=accounting.PrivacyReport(0.2))
    cfg = noisy_gd.NoisyGDConfig(l2_clip=1.0, noise_multiplier=1.0, steps=2, learning_rate=0.1)
    with pytest.raises(ValueError, match="report.delta = 0.2 >= 1/n"):
        noisy_gd.task_weighted_noisy_gd(KEY, task, user, x, y, w, n_tasks, n_users, cfg, clip_x=1.0, clip_y=1.0,
                                        report=accounting.PrivacyReport(0.2))


def test_clis_apply_the_library_rule_before_any_work(capsys, monkeypatch):
    from jdp.meta import cli as meta_cli

    with monkeypatch.context() as m:  # refused before the tasks are generated or anything calibrated
        _accountants_fail(m)
        m.setattr(meta_cli, "_tasks", lambda args: pytest.fail("tasks generated before the refusal"))
        assert main(["meta", "--delta", "0.01"]) == 2  # 300 tasks by default
        assert "--delta = 0.01 >= 1/n" in capsys.readouterr().err
        assert main(["meta", "--epsilon", "1e12"]) == 2
        assert "--epsilon = 1e+12 is above the largest target" in capsys.readouterr().err
    assert main(["altmin", "--synthetic-size", "100", "30", "800", "--delta", "0.5"]) == 2
    assert "delta = 0.5 >= 1/n = 0.01 for n = 100 protected users" in capsys.readouterr().err


def test_select_refuses_an_epsilon_beyond_the_maximum():
    """`select` took any finite ε: at 1e12 the CLI's report raised ZeroDivisionError after the work."""
    import jax
    import numpy as np
    import pytest as _pytest

    from jdp.selection import select
    with _pytest.raises(ValueError, match="above the largest target"):
        select("em", jax.random.key(0), np.zeros(4), np.ones(4), 1e12)
