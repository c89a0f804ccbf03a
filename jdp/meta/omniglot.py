"""Omniglot folders -> arrays, and N-way K-shot task sampling as a TaskSet.

Reads the standard layout `root/images_background/<alphabet>/<character>/*.png` and
`root/images_evaluation/...` (either or both; the authors merge them and split characters 90/10 at
random). Images are converted to grayscale, resized to `size`×`size`, scaled to [0, 1]. Tasks are drawn
with jax.random (static shapes, vmappable): n_way distinct characters, k_shot + n_query distinct images
of each; labels are 0..n_way-1 in a random order per task. Example layout per task: the first
n_way·k_shot examples are the support set (fine-tuning), the rest the query set (`TaskSet.split_points`).
Privacy unit for meta-learning on these tasks: one sampled task; note that sampled tasks share
characters, so task-level DP here protects a task, not a character or a writer.
"""
from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from jdp.meta.tasks import TaskSet

SPLITS = ("images_background", "images_evaluation")
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".pgm")


@dataclasses.dataclass(frozen=True)
class OmniglotData:
    """images [C, M, size, size] float32 in [0, 1] (M = most drawings of any character, zero-padded),
    counts [C] real drawings per character, names ["split/alphabet/character"]."""
    images: np.ndarray
    counts: np.ndarray
    names: tuple[str, ...]

    @property
    def n_characters(self) -> int:
        return int(self.images.shape[0])


def load_omniglot(root, splits=SPLITS, size: int = 28, invert: bool = False) -> OmniglotData:
    """Loads every character folder under root/<split>/<alphabet>/<character>/ (sorted, deterministic).
    Needs pillow (`pip install pillow`, or the checkout's extra `pip install -e '.[omniglot]'`)."""
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("reading Omniglot needs pillow: pip install pillow (or the checkout's extra: "
                          "pip install -e '.[omniglot]')") from None

    root = pathlib.Path(root)
    if isinstance(splits, str):
        splits = (splits,)
    if int(size) < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    chars: list[tuple[str, list[pathlib.Path]]] = []
    for split in splits:
        d = root / split
        if not d.is_dir():
            raise ValueError(f"splits: folder {d} not found (expected the standard Omniglot layout)")
        for alphabet in sorted(p for p in d.iterdir() if p.is_dir()):
            for char in sorted(p for p in alphabet.iterdir() if p.is_dir()):
                files = sorted(f for f in char.iterdir() if f.suffix.lower() in _IMAGE_SUFFIXES)
                if files:
                    chars.append((f"{split}/{alphabet.name}/{char.name}", files))
    if not chars:
        raise ValueError(f"root: no character images found under {root} for splits {tuple(splits)}")
    m = max(len(f) for _, f in chars)
    images = np.zeros((len(chars), m, size, size), np.float32)
    counts = np.zeros((len(chars),), np.int32)
    for c, (_, files) in enumerate(chars):
        counts[c] = len(files)
        for i, f in enumerate(files):
            with Image.open(f) as im:
                a = np.asarray(im.convert("L").resize((size, size), Image.LANCZOS), np.float32) / 255.0
            images[c, i] = 1.0 - a if invert else a
    return OmniglotData(images, counts, tuple(n for n, _ in chars))


def split_characters(key, n_characters: int, test_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Random (train, test) split of character ids (the authors: 90/10 over all 1623 characters)."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    perm = np.asarray(jax.random.permutation(key, n_characters))
    n_test = max(1, int(round(test_fraction * n_characters)))
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def sample_tasks(key, data: OmniglotData, n_tasks: int, n_way: int = 5, k_shot: int = 5, n_query: int = 1,
                 characters=None) -> TaskSet:
    """n_tasks N-way K-shot tasks: data = (x [T, N(K+Q), size, size, 1], y [T, N(K+Q)] int32); the first
    N·K examples of each task are the support set (k_shot per class), the remaining N·Q the queries."""
    chars = np.arange(data.n_characters) if characters is None else np.asarray(characters)
    per = k_shot + n_query
    if int(n_tasks) < 1 or int(k_shot) < 1 or int(n_query) < 0:
        raise ValueError(f"need n_tasks >= 1, k_shot >= 1, n_query >= 0, got {n_tasks}, {k_shot}, {n_query}")
    if chars.size == 0 or chars.min() < 0 or chars.max() >= data.n_characters:
        raise ValueError(f"characters must be ids in [0, {data.n_characters})")
    if not 1 <= int(n_way) <= chars.size:
        raise ValueError(f"n_way must be in [1, {chars.size}] (available characters), got {n_way}")
    ok = data.counts[chars] >= per
    if ok.sum() < n_way:
        raise ValueError(f"k_shot + n_query = {per}: fewer than n_way={n_way} characters have that many images")
    allowed = np.zeros(data.n_characters, bool)
    allowed[chars[ok]] = True
    x, y = _sample(key, jnp.asarray(data.images), jnp.asarray(data.counts), jnp.asarray(allowed), int(n_tasks),
                   int(n_way), int(k_shot), int(n_query))
    return TaskSet((x, y), jnp.ones(y.shape, jnp.float32))


@functools.partial(jax.jit, static_argnames=("n_tasks", "n_way", "k_shot", "n_query"))
def _sample(key, images, counts, allowed, n_tasks, n_way, k_shot, n_query):
    per = k_shot + n_query

    def one(k):
        kc, ki = jax.random.split(k)
        # n_way distinct allowed characters (top-k of Gumbel noise); label = position
        g = jax.random.gumbel(kc, allowed.shape) + jnp.where(allowed, 0.0, -jnp.inf)
        picked = jax.lax.top_k(g, n_way)[1]

        def draws(c, kk):  # `per` distinct drawings of character c (top-k of Gumbel over real ones)
            g = jax.random.gumbel(kk, (images.shape[1],))
            g = jnp.where(jnp.arange(images.shape[1]) < counts[c], g, -jnp.inf)
            return jax.lax.top_k(g, per)[1]

        idx = jax.vmap(draws)(picked, jax.random.split(ki, n_way))  # [N, per]
        x = images[picked[:, None], idx]  # [N, per, s, s]
        sup = x[:, :k_shot].reshape((-1,) + x.shape[2:])
        qry = x[:, k_shot:].reshape((-1,) + x.shape[2:])
        labels = jnp.arange(n_way, dtype=jnp.int32)
        y = jnp.concatenate([jnp.repeat(labels, k_shot), jnp.repeat(labels, n_query)])
        return jnp.concatenate([sup, qry])[..., None], y

    return jax.vmap(one)(jax.random.split(key, n_tasks))


def conv_classifier(key, n_way: int, image_size: int = 28, channels: int = 64):
    """The paper's Omniglot network as (params, loss_fn) for `SGDLearner`: 4 × [conv 3×3 stride 2,
    LayerNorm, ReLU] + linear head; loss_fn(params, (x [s, s, 1], y [])) = cross-entropy.

    LayerNorm replaces the authors' BatchNorm, whose running statistics are data-dependent buffers that
    their code neither privatises nor meta-learns.
    """
    import flax.linen as nn
    import optax

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(4):
                x = nn.relu(nn.LayerNorm()(nn.Conv(channels, (3, 3), strides=2, padding=1)(x)))
            return nn.Dense(n_way)(x.reshape(x.shape[:-3] + (-1,)))

    net = Net()
    params = net.init(key, jnp.zeros((1, image_size, image_size, 1)))

    def loss_fn(p, example):
        x, y = example
        logits = net.apply(p, x[None])[0]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y)

    return params, loss_fn
