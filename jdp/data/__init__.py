"""jdp.data: sparse interactions, MovieLens readers, splits and synthetic generators.

Data plumbing, not private routines: nothing here is released, and the counts computed here are
exact (for non-private code and evaluation only).
"""
from jdp.data.interactions import Interactions, concat
from jdp.data.movielens import load_ml100k, load_movielens
from jdp.data.splits import fold_in_split, split_ratings
from jdp.data.synthetic import SyntheticTasks, appendix_c, planted_movielens, planted_powerlaw

__all__ = [
    "Interactions", "concat", "load_movielens", "load_ml100k", "split_ratings", "fold_in_split",
    "SyntheticTasks", "appendix_c", "planted_movielens", "planted_powerlaw",
]
