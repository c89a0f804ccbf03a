"""SASRec / rating readers, leave-last-out split, padding, item presence, full-ranking metrics."""
import jax.numpy as jnp
import numpy as np
import pytest

from jdp.seqrec import data
from jdp.seqrec.evaluate import evaluate, ndcg_hit_from_ranks


def test_sasrec_reader_split_and_left_padding(tmp_path):
    f = tmp_path / "toy.txt"
    # user 7 first (5 items), user 3 (2 items: train only), user 9 (3 items)
    f.write_text("7 50\n7 40\n3 40\n7 60\n7 50\n9 70\n7 80\n3 90\n9 40\n9 60\n")
    seqs, n_items = data.read_sasrec(f)
    # items re-indexed by first appearance: 50->1, 40->2, 60->3, 80->4, 90->5, 70->6
    assert n_items == 6
    np.testing.assert_array_equal(seqs[0], [1, 2, 3, 1, 4])
    np.testing.assert_array_equal(seqs[1], [2, 5])
    np.testing.assert_array_equal(seqs[2], [6, 2, 3])
    d = data.leave_last_out(seqs, n_items, maxlen=3)
    # user 0: train [1,2,3], valid 1, test 4
    np.testing.assert_array_equal(d.train_input[0], [0, 1, 2])
    np.testing.assert_array_equal(d.train_target[0], [0, 2, 3])
    np.testing.assert_array_equal(d.valid_input[0], [1, 2, 3])
    np.testing.assert_array_equal(d.test_input[0], [2, 3, 1])  # most recent maxlen items
    assert (d.valid_target[0], d.test_target[0]) == (1, 4)
    # user 1 (< 3 items): all in train, not evaluated
    np.testing.assert_array_equal(d.train_input[1], [0, 0, 2])
    np.testing.assert_array_equal(d.train_target[1], [0, 0, 5])
    assert d.valid_target[1] == 0 and d.test_target[1] == 0
    # user 2: train [6], no next-item pairs
    assert not d.train_target[2].any() and d.valid_target[2] == 2 and d.test_target[2] == 3
    np.testing.assert_array_equal(d.valid_input[2], [0, 0, 6])
    pres = data.item_presence(d.train_input, d.train_target, n_items)
    # user 2 has no training pair, so its item 6 is not used in training (count 0)
    np.testing.assert_array_equal(pres, [0, 1, 2, 1, 0, 1, 0])


def test_rating_reader_sorts_by_time_and_filters(tmp_path):
    f = tmp_path / "ratings.dat"
    rows = [(2, 10, 5, 300), (2, 11, 3, 100), (1, 11, 4, 50), (2, 12, 4, 200), (1, 10, 2, 40), (1, 13, 1, 10)]
    f.write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in rows))
    seqs, n = data.read_ratings(f, min_user_count=1, min_item_count=1)
    # user 2 appears first in the file; its items by time: 11, 12, 10 -> ids 1, 2, 3; user 1: 13, 10, 11
    assert n == 4
    np.testing.assert_array_equal(seqs[0], [1, 2, 3])
    np.testing.assert_array_equal(seqs[1], [4, 3, 1])
    seqs2, n2 = data.read_ratings(f, min_user_count=1, min_item_count=2)  # drops items 12 and 13
    assert n2 == 2 and [len(s) for s in seqs2] == [2, 2]
    g = tmp_path / "u.data"
    g.write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows))
    np.testing.assert_array_equal(data.read_ratings(g, 1, 1)[0][1], [4, 3, 1])
    with pytest.raises(ValueError, match="data_path"):
        data.read_sasrec(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="data must be"):
        data.load("netflix", path=f)


def test_ml1m_loader_reads_a_generated_ratings_dat(tmp_path):
    """ML-1M (paper Table 1) from a user-given path: `user::item::rating::timestamp`, SASRec preprocessing
    (users and items with >= 5 ratings, time order, leave-last-out, maxlen 200)."""
    rng = np.random.default_rng(0)
    lines = []
    for u in range(1, 41):
        items = rng.choice(np.arange(1, 31), size=rng.integers(3, 12), replace=False)
        lines += [f"{u}::{i}::{rng.integers(1, 6)}::{1000 * u + t}\n" for t, i in enumerate(items)]
    f = tmp_path / "ratings.dat"
    f.write_text("".join(lines))
    d = data.load("ml-1m", path=f)
    seqs, n = data.read_ratings(f)
    assert d.maxlen == 200 and d.n_items == n and d.n_users == len(seqs)
    assert all(len(s) >= 5 for s in seqs)  # the per-user filter
    last = [s[-1] for s in seqs]
    np.testing.assert_array_equal(d.test_target, last)
    np.testing.assert_array_equal(d.valid_target, [s[-2] for s in seqs])
    assert d.test_input[0, -1] == seqs[0][-2] and d.train_target[0, -1] == seqs[0][-3]


def test_synthetic_needs_no_file_and_a_folder_path_finds_the_file(tmp_path):
    """`--data synthetic`: planted_sequences(seed=data_seed) through the same vocabulary and split."""
    from jdp.cli import build_parser
    from jdp.data.synthetic import planted_sequences
    d = data.load("synthetic", data_seed=2)
    raw, _ = planted_sequences(seed=2)
    assert d.maxlen == data.SYNTHETIC_MAXLEN == 20 and d.n_users == len(raw) == 2000 and d.n_items == np.unique(np.concatenate(raw)).size
    evaluated = [s for s in raw if s.size >= 3]
    assert (d.test_target > 0).sum() == len(evaluated)  # users with < 3 items are not evaluated
    assert any("exact item counts" in a for a in d.vocab_assumptions)
    assert not np.array_equal(data.load("synthetic", data_seed=3).test_target, d.test_target)
    args = build_parser().parse_args(["seqrec", "--data", "synthetic", "--data-seed", "2"])
    assert args.data == "synthetic" and args.data_seed == 2 and args.data_path is None
    (tmp_path / "ratings.dat").write_text("".join(f"{u}::{i}::5::{u * 100 + i}\n" for u in range(1, 7)
                                                  for i in range(1, 7)))
    assert data.load("ml-1m", path=tmp_path).n_users == 6  # a folder: its ratings.dat


def test_real_datasets_statistics(datasets_dir):
    seqs, n = data.read_sasrec(datasets_dir / "amazon-games" / "Video.txt")
    assert (len(seqs), n, sum(len(s) for s in seqs)) == (31013, 23715, 287107)
    d = data.load("ml-100k", datasets_dir=datasets_dir)
    assert d.maxlen == 200 and d.n_users == 943 and (d.test_target > 0).all()


def test_metrics_on_hand_made_ranks():
    m = ndcg_hit_from_ranks(np.array([0, 1, 9, 10, 500]))
    assert m["hit"] == pytest.approx(3 / 5)
    assert m["ndcg"] == pytest.approx((1.0 + 1 / np.log2(3) + 1 / np.log2(11)) / 5)


class _FixedScores:
    """Stand-in model: logits depend only on the last input item (a fixed score table)."""
    def __init__(self, table):
        self.table = jnp.asarray(table, jnp.float32)

    def apply(self, params, inputs, deterministic=True, reatt=None, last_only=True):
        return self.table[inputs[:, -1]][:, None, :]


def test_full_ranking_excludes_padding_and_optionally_history():
    # 5 items; scores by last item. Padding column 0 has the highest raw score but is never ranked.
    table = np.array([[0, 0, 0, 0, 0, 0],
                      [9, 1, 5, 4, 3, 2],     # last item 1: ranking 2 > 3 > 4 > 5 > 1
                      [9, 2, 1, 3, 4, 5]])    # last item 2: 5 > 4 > 3 > 1 > 2
    model = _FixedScores(table)
    inputs = np.array([[0, 1], [3, 1], [1, 2], [0, 0]])
    targets = np.array([3, 3, 1, 0])  # last user has no target: skipped
    r = evaluate(model, None, inputs, targets, k=2, chunk=2)
    # ranks: user0 target 3 -> rank 1; user1 -> 1; user2 target 1 -> rank 3
    assert r["n_users"] == 3
    assert r["hit"] == pytest.approx(2 / 3)
    assert r["ndcg"] == pytest.approx(2 / 3 / np.log2(3))
    # masking history removes item 3 from user1's candidates? no: it is the target (kept); removes item 1
    r2 = evaluate(model, None, inputs, targets, k=2, chunk=2, mask_history=True)
    # user2 history {1, 2}: target 1 kept, item 2 removed -> rank 3 still (5, 4, 3 above); user0: item 1 removed
    assert r2["hit"] == pytest.approx(2 / 3)
    r3 = evaluate(model, None, inputs, np.array([2, 4, 1, 0]), k=1, chunk=4, mask_history=True)
    # user0 target 2 rank 0; user1 history {3,1}: target 4 ranks after 2 -> 1; user2 rank 3
    assert r3["hit"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="no users"):
        evaluate(model, None, inputs, np.zeros(4, int), k=2)


def test_one_rank_function_gives_both_history_protocols():
    from jdp.seqrec.evaluate import make_rank_fn_reatt
    rng = np.random.default_rng(1)
    model = _FixedScores(rng.normal(size=(9, 9)))
    inputs, targets = rng.integers(0, 9, (40, 4)), rng.integers(0, 9, 40)
    for mask_history in (False, True):
        both = evaluate(model, None, inputs, targets, k=3, chunk=16,
                        rank_fn=make_rank_fn_reatt(model, mask_history, both_protocols=True))
        this = evaluate(model, None, inputs, targets, k=3, chunk=16, mask_history=mask_history)
        other = evaluate(model, None, inputs, targets, k=3, chunk=16, mask_history=not mask_history)
        assert (both["ndcg"], both["hit"]) == (this["ndcg"], this["hit"])
        assert both["other"] == {"ndcg": other["ndcg"], "hit": other["hit"]}
    assert this["hit"] != other["hit"]  # the two protocols differ on this data


def test_evaluation_pads_to_few_shapes_without_changing_the_metrics():
    from jdp.seqrec.evaluate import make_rank_fn_reatt
    rng = np.random.default_rng(0)
    table = rng.normal(size=(7, 7))
    model = _FixedScores(table)
    rank_fn = make_rank_fn_reatt(model)
    inputs = rng.integers(1, 7, (300, 5))
    inputs[:120, :3] = 0  # short histories: their own length bucket
    first = evaluate(model, None, inputs[:250], rng.integers(1, 7, 250), chunk=64, rank_fn=rank_fn,
                     length_buckets=(2,))
    targets = rng.integers(1, 7, 300)
    other = evaluate(model, None, inputs[50:], targets[50:], chunk=64, rank_fn=rank_fn, length_buckets=(2,))
    # calls are padded to the chunk or a power of two: per window at most log2(64) + 1 sizes, whatever the users
    assert rank_fn.func._cache_size() <= 2 * 7
    # the padding never enters the metric: brute force over the same users
    ranks = [np.sum(np.delete(table[row[-1]], 0) >= table[row[-1]][t]) - 1 for row, t in zip(inputs[50:], targets[50:])]
    ranks = np.asarray(ranks)
    assert other["hit"] == pytest.approx(np.mean(ranks < 10)) and 0 < first["hit"] <= 1
    assert other["ndcg"] == pytest.approx(np.mean((ranks < 10) / np.log2(ranks + 2)))
