"""Omniglot folder loader and N-way K-shot task sampling on tiny generated PNG images."""
import jax
import numpy as np
import pytest
from PIL import Image

from jdp.meta import omniglot


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    """2 splits x 2 alphabets x 3 characters x 4 drawings of 8x8; pixel value encodes (character, drawing)."""
    root = tmp_path_factory.mktemp("omniglot")
    c = 0
    for split in omniglot.SPLITS:
        for a in range(2):
            for ch in range(3):
                d = root / split / f"Alphabet_{a}" / f"character{ch + 1:02d}"
                d.mkdir(parents=True)
                for i in range(4 if c != 5 else 3):  # one character has only 3 drawings
                    val = 10 * c + i
                    Image.fromarray(np.full((8, 8), val, np.uint8)).save(d / f"{c:04d}_{i:02d}.png")
                c += 1
    return root


def test_load_layout_values_and_counts(tiny_root):
    data = omniglot.load_omniglot(tiny_root, size=8)
    assert data.images.shape == (12, 4, 8, 8) and data.n_characters == 12
    assert data.names[0] == "images_background/Alphabet_0/character01"
    assert data.names[6].startswith("images_evaluation/")
    np.testing.assert_allclose(data.images[7, 2], (70 + 2) / 255.0, atol=1e-6)
    assert data.counts[5] == 3 and data.counts.sum() == 47
    assert float(data.images[5, 3].max()) == 0.0  # padding slot
    only_bg = omniglot.load_omniglot(tiny_root, splits="images_background", size=8)
    assert only_bg.n_characters == 6
    inv = omniglot.load_omniglot(tiny_root, splits="images_background", size=8, invert=True)
    np.testing.assert_allclose(inv.images[0, 0], 1.0 - only_bg.images[0, 0])


def test_n_way_k_shot_tasks(tiny_root):
    data = omniglot.load_omniglot(tiny_root, size=8)
    n_way, k_shot, n_query = 3, 2, 1
    tasks = omniglot.sample_tasks(jax.random.PRNGKey(0), data, 50, n_way, k_shot, n_query)
    x, y = tasks.data
    assert x.shape == (50, n_way * (k_shot + n_query), 8, 8, 1) and y.shape == (50, 9)
    code = np.rint(np.asarray(x[..., 0, 0, 0]) * 255).astype(int)  # 10 * character + drawing
    char, draw = code // 10, code % 10
    sup, qry = tasks.split_points(n_way * k_shot)
    assert sup.data[1].shape == (50, 6) and qry.data[1].shape == (50, 3)
    seen_chars = set()
    for t in range(50):
        labels = np.asarray(y[t])
        np.testing.assert_array_equal(labels[:6], np.repeat(np.arange(3), 2))
        for lab in range(n_way):  # one character per label, distinct drawings, shared by support and query
            cs, ds = char[t][labels == lab], draw[t][labels == lab]
            assert len(set(cs)) == 1 and len(set(ds)) == len(ds)
            assert not (cs[0] == 5 and ds.max() > 2)  # never the missing (padded) drawing
        assert len(set(char[t])) == n_way
        seen_chars |= set(char[t])
    assert len(seen_chars) == 12  # every character gets used over 50 tasks
    train, test = omniglot.split_characters(jax.random.PRNGKey(1), data.n_characters, 0.25)
    assert len(test) == 3 and not set(train) & set(test)
    t2 = omniglot.sample_tasks(jax.random.PRNGKey(2), data, 50, 3, 2, 1, characters=test)  # same compiled shape
    assert set(np.unique(np.rint(np.asarray(t2.data[0][..., 0, 0, 0]) * 255).astype(int) // 10)) == set(test)


def test_bad_inputs(tiny_root, tmp_path):
    data = omniglot.load_omniglot(tiny_root, size=8)
    with pytest.raises(ValueError, match="n_way"):
        omniglot.sample_tasks(jax.random.PRNGKey(0), data, 2, n_way=13)
    with pytest.raises(ValueError, match="k_shot"):
        omniglot.sample_tasks(jax.random.PRNGKey(0), data, 2, n_way=2, k_shot=5, n_query=1)
    with pytest.raises(ValueError, match="characters"):
        omniglot.sample_tasks(jax.random.PRNGKey(0), data, 2, n_way=2, k_shot=1, characters=[99])
    with pytest.raises(ValueError, match="splits"):
        omniglot.load_omniglot(tmp_path)
    (tmp_path / "images_background").mkdir()
    with pytest.raises(ValueError, match="root"):
        omniglot.load_omniglot(tmp_path, splits="images_background")


@pytest.mark.slow
def test_meta_nsgd_on_tiny_omniglot_tasks(tiny_root):
    from jdp import meta as M
    data = omniglot.load_omniglot(tiny_root, size=8)
    tasks = omniglot.sample_tasks(jax.random.PRNGKey(0), data, 20, n_way=3, k_shot=2, n_query=1)
    params, loss = omniglot.conv_classifier(jax.random.PRNGKey(1), 3, image_size=8, channels=4)
    learner = M.SGDLearner(loss, lam=0.2, steps=3, lr=0.1, batch_size=4)
    res = M.meta_nsgd(jax.random.PRNGKey(2), tasks, learner, params, epsilon=8.0, delta=1e-5, steps=3,
                      batch_size=5, meta_lr=0.5, l2_clip=0.5)
    assert jax.tree.structure(res.params()) == jax.tree.structure(params)
    sup, qry = tasks.split_points(6)
    assert np.isfinite(M.transfer_risk(jax.random.PRNGKey(3), learner, res, sup, qry))
