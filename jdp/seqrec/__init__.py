"""DPFormer: DP sequential recommendation (Transformer with Re-Attention, GRU/LSTM baselines).

    from jdp import seqrec
    data = seqrec.load("synthetic")                                   # or load("amazon-games", path=fetch(...))
    result = seqrec.train.train(data, seqrec.TrainConfig(model="dpformer", epsilon=8.0), key)
    print(result.privacy, result.metrics)

Modules: `data` (readers, vocabulary, leave-last-out split), `models` (Transformer/DPFormer, GRU, LSTM),
`reattention` (the Re-Attention correction and its private item histogram), `train` (DP-SGD through
`jdp.clipping`: the loop) and what it runs with: `config` (TrainConfig), `releases` (sampling plan, releases before
the steps, σ, report), `prepare` (model, starting parameters, step functions), `batches` (a step's length chunks
and negatives), `item_table`, `nonprivate` (the reference step), `checkpoint`; `evaluate` (full-ranking NDCG/HIT),
`transitions` (a private item-to-item recommender trained by one Gaussian release: the strong private baseline),
`cli` (`jdp seqrec`). The functions `train.train` and `evaluate.evaluate` keep their modules' names, so they are
not re-exported here.
"""
from jdp.seqrec import data, evaluate, models, reattention, train, transitions
from jdp.seqrec.config import TrainConfig
from jdp.seqrec.data import SeqData, leave_last_out, load, read_ratings, read_sasrec
from jdp.seqrec.evaluate import ndcg_hit_from_ranks
from jdp.seqrec.models import MODELS, make_loss_fn, make_model
from jdp.seqrec.reattention import private_item_counts
from jdp.seqrec.releases import sampling_plan
from jdp.seqrec.train import TrainResult

__all__ = ["MODELS", "SeqData", "TrainConfig", "TrainResult", "data", "evaluate", "leave_last_out", "load",
           "make_loss_fn", "make_model", "models", "ndcg_hit_from_ranks", "private_item_counts", "read_ratings",
           "read_sasrec", "reattention", "sampling_plan", "train", "transitions"]
