"""jdp.data: sparse interactions, MovieLens readers, dataset downloads, splits and synthetic generators.

Data plumbing, not private routines: nothing here is released, and the counts computed here are
exact (for non-private code and evaluation only). `check_unique_pairs` is the one validation point
of the "one observation per (user, item)" assumption of the user-level private routines, and
`Interactions.merge_duplicates` the one way to merge duplicates (mean rating) before they run.
"""
from jdp.data.download import fetch
from jdp.data.interactions import Interactions, check_unique_pairs, concat, duplicate_pairs
from jdp.data.movielens import RatingScale, load_ml100k, load_movielens, load_movielens_items, movielens_scale
from jdp.data.splits import fold_in_split, split_ratings, split_ratings_by_pair_hash
from jdp.data.synthetic import SyntheticTasks, appendix_c, planted_movielens, planted_powerlaw

__all__ = [
    "fetch", "Interactions", "check_unique_pairs", "concat", "duplicate_pairs", "load_movielens", "load_movielens_items", "load_ml100k",
    "movielens_scale", "RatingScale", "split_ratings", "split_ratings_by_pair_hash", "fold_in_split",
    "SyntheticTasks", "appendix_c", "planted_movielens", "planted_powerlaw",
]
