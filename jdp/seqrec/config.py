"""`TrainConfig`: the hyper-parameters of a `jdp.seqrec.train` run, their public constants and the one check of
them (`TrainConfig.validate`)."""
from __future__ import annotations

import dataclasses
import math

from jdp.clipping import METHODS as CLIPPING_METHODS
from jdp.clipping.engine import check_batch_chunk
from jdp.seqrec.models import NORMS, check_item_dim
from jdp.validation import check_positive, check_privacy

# Shorter windows (compute only): every length up to 8, then steps of ~25%, so a user's window wastes
# at most ~20% of its positions. Each window used compiles one chunk shape (plus one for a step's last chunk).
DEFAULT_WINDOWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128,
                   160, 192, 224, 256)

NEGATIVE_SAMPLERS = ("uniform", "popularity")
ITEM_INITS = ("auto", "random", "transitions")
# item_init="transitions" without a declared noise: the item releases alone would spend this share of ε (a public
# rule; under RDP composition the DP-SGD steps' σ then grows by ~10% at ε = 8, not by half)
ITEM_INIT_EPSILON_SHARE = 0.5
# ... and with the transition prior (the release also in the logits), most of ε goes to the release. Chosen on one
# data set's validation split (Amazon Games, ε = 8: DPFormer's NDCG@10 2.72 at 0.85, σ_T 0.74, against 2.65 at 0.95,
# where DP-SGD is left σ 2.0); test at ε = 5 / 8 / 10: 1.79 / 2.17 / 2.40 against 1.36 / 1.64 / 1.81 for half of ε
# without the prior (two seeds each, benchmarks/seqrec/README.md)
PRIOR_EPSILON_SHARE = 0.85
# the Transformers' dropout: the paper's from a random start; lower with the transition prior, where the network starts
# as its release's scorer and that score reaches the output through one item row (the last item's), half of which
# dropout 0.5 masks at every step. Chosen on one data set's validation split (Amazon Games, ε = 8, two seeds:
# benchmarks/seqrec/README.md); SASRec's own rule already uses 0.2 on MovieLens
DROPOUT = 0.5
PRIOR_DROPOUT = 0.2
# the optimiser after DP-SGD's noisy mean: AdamW (the paper's), DP-AdamBC (jdp.clipping.dp_adam_bc: Adam's second
# moment minus the known noise variance) or SGD with momentum 0.9
OPTIMIZERS = ("adamw", "adam-bc", "sgd-momentum")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters (paper defaults where it states them: warm-up 20%, Adam, wd 1e-5, C = 1)."""
    model: str = "dpformer"
    epsilon: float | None = 8.0       # None = non-private reference run
    delta: float = 1e-5
    epochs: float = 100.0
    batch_size: int = 1024            # expected Poisson batch size B = qN
    lr: float = 1e-3
    warmup_frac: float = 0.2
    weight_decay: float = 1e-5
    optimizer: str = "adamw"          # one of OPTIMIZERS ("adam-bc" / "sgd-momentum": beyond the paper)
    adam_bc_gamma: float = 10.0       # DP-AdamBC's floor γ in units of the noise variance (σC/B)² (public)
    l2_clip: float = 1.0
    normalize: bool = False           # normalised clipping g·C/‖g‖ (the paper's choice) instead of min(1, C/‖g‖)
    clipping: str = "auto"            # jdp.clipping method ("vmap": the exact per-example reference)
    batch_chunk: int | str | None = "auto"  # users per pass inside each physical chunk: jdp.clipping's batch_chunk
                                      # ("auto": on CPU chunks of 4 users whose per-user embedding gradients are
                                      # kept for the clipped sum, DP epoch 47 s vs 64 s in one pass; None: one
                                      # pass); the non-private reference likewise (`nonprivate.nonprivate_chunk`)
    d: int = 64
    heads: int = 1
    blocks: int = 2
    dropout: float | None = None      # None: PRIOR_DROPOUT with the transition prior, else DROPOUT (`dropout_rate`)
    activation: str = "relu"
    norm: str = "pre"                 # Transformer blocks: "pre" (SASRec) or "post" (Vaswani et al.'s encoder)
    ffn_dim: int | None = None        # Transformer feed-forward width (None = d)
    item_dim: int | None = None       # vanilla Transformers: item table width r (None = d); r < d adds learned r→d
                                      # and d→r projections (`TransformerRec.item_dim`)
    chunk_rows: int = 1024            # users × window positions per jit call (physical chunk; 1024: ~1.3× the real
                                      # positions on Amazon Games at B = 1024, 2048: ~1.55×, same speed per position)
    hist_noise_multiplier: float = 10.0  # Gaussian histogram noise / sqrt(maxlen+1)
    error_scale: float = 1.0          # multiplies Re-Attention's effective errors (paper: 1)
    eval_every_epochs: float = 0.0    # 0 = only at the end (validation history otherwise)
    mask_history: bool = False
    eval_chunk: int = 1024
    length_buckets: tuple = DEFAULT_WINDOWS  # window lengths for shorter sequences (compute only)
    n_users_public: int | None = None  # declared public bound on the users: sets q = B/N and the steps
    negatives: int = 0                # 0 = full softmax (the paper); K > 0 = sampled softmax, K items per step
    negative_sampler: str = "uniform"  # "uniform" or "popularity" (public or released counts, see train)
    trainable_items: int = 0          # 0 = every item embedding row trains; K > 0 = only the K items with the
                                      # largest public or released counts (`frozen_item_rows`)
    item_init: str = "auto"           # "transitions" (beyond the paper): the tied item table starts from ONE
                                      # release of item-to-item transitions (`start_from_item_table`); "random":
                                      # the paper's start; "auto": transitions for a private run of a model that
                                      # can start from it (`can_start_from_release`), else random (`item_start`)
    item_init_k: int | None = None    # its candidate items; None: `transitions.default_k` of the declared users
                                      # and the release's noise (public), 500 for the NON-PRIVATE reference
    sparse_item_rows: bool = False    # DP-FEST on the item table (beyond the paper; jdp.clipping.sparse_rows): each
                                      # step noises and updates only the rows selected from noisy counts of the
                                      # sampled users' input and target items; the same ε (σ split, ratio below)
    sparse_ratio: float = 2.0         # its σ_r / σ_g (public)
    sparse_threshold: float = 3.0     # its threshold in units of σ_r (public)
    freeze_item_table: bool = False   # the item table never trains (not differentiated, its noise discarded):
                                      # with item_init="transitions" it keeps the release; DP-SGD trains the rest
    item_init_noise: float | None = None  # its Gaussian noise std (per-user Frobenius norm 1), composed with
                                      # DP-SGD; None: calibrated so that the item releases alone meet
                                      # (share·ε, δ), share = `item_init_epsilon_share()`
    transition_prior: bool | None = None  # the item start's release also scores every position (beyond the
                                      # paper): log(1 + its positive transition scores over the last 3 items, in
                                      # units of its noise) times a learned scale is added to the logits
                                      # (`models.transition_prior`); None: wherever the run starts from the release
                                      # with a full softmax (`uses_transition_prior`)

    def validate(self) -> None:
        check_privacy(self.epsilon, self.delta, None, unit="user")  # δ < 1/n: in `sampling_plan`
        for name in ("epochs", "lr", "l2_clip", "hist_noise_multiplier"):
            check_positive(getattr(self, name), name)
        check_positive(self.weight_decay, "weight_decay", allow_zero=True)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        check_positive(self.adam_bc_gamma, "adam_bc_gamma")
        check_positive(self.error_scale, "error_scale", allow_zero=True)
        rate = self.dropout
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate < 1.0):
            raise ValueError(f"dropout must be None or in [0, 1), got {self.dropout!r}")
        check_positive(self.sparse_ratio, "sparse_ratio")
        if not math.isfinite(self.sparse_threshold):
            raise ValueError(f"sparse_threshold must be finite, got {self.sparse_threshold!r}")
        if self.sparse_item_rows and (self.model not in ("dpformer", "transformer") or self.freeze_item_table):
            raise ValueError("sparse_item_rows needs a trained tied item table: model 'dpformer' or 'transformer' "
                             "without freeze_item_table")
        if not 0.0 <= self.warmup_frac < 1.0:
            raise ValueError(f"warmup_frac must be in [0, 1), got {self.warmup_frac}")
        for name in ("batch_size", "chunk_rows", "d", "heads", "blocks", "eval_chunk"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_batch_chunk(self.batch_chunk)
        if int(self.negatives) < 0:
            raise ValueError(f"negatives must be >= 0, got {self.negatives}")
        if int(self.trainable_items) < 0:
            raise ValueError(f"trainable_items must be >= 0, got {self.trainable_items}")
        if self.item_init not in ITEM_INITS:
            raise ValueError(f"item_init must be one of {ITEM_INITS}, got {self.item_init!r}")
        if self.item_init == "transitions" and not self.can_start_from_release():
            raise ValueError("item_init='transitions' needs a tied d-wide item table and a final LayerNorm: "
                             "model 'dpformer' or 'transformer' with norm='pre', d >= 2, without item_dim")
        if self.item_init_k is not None and (isinstance(self.item_init_k, bool)
                                             or int(self.item_init_k) != self.item_init_k or self.item_init_k < 1):
            raise ValueError(f"item_init_k must be a positive integer, got {self.item_init_k}")
        if self.item_init_noise is not None:
            check_positive(self.item_init_noise, "item_init_noise")
        for name in ("item_init_k", "item_init_noise"):  # used as given or refused
            if getattr(self, name) is not None and self.item_start() == "random":
                raise ValueError(f"{name} must be left unset (None): it sets the item table's release start, which "
                                 f"this config does not make (item_init={self.item_init!r} starts at random here: "
                                 f"model {self.model!r}, epsilon {self.epsilon})")
        if self.transition_prior not in (None, True, False):
            raise ValueError(f"transition_prior must be None, True or False, got {self.transition_prior!r}")
        if self.transition_prior and (self.item_start() != "transitions" or self.negatives):
            raise ValueError("transition_prior scores with the item start's release over the full catalogue: it needs "
                             "item_init='transitions' (or 'auto' resolved to it) and negatives=0")
        if self.negative_sampler not in NEGATIVE_SAMPLERS:
            raise ValueError(f"negative_sampler must be one of {NEGATIVE_SAMPLERS}, got {self.negative_sampler!r}")
        if self.negatives and self.model == "transformer-untied":
            raise ValueError("a sampled softmax (negatives > 0) needs a tied output embedding")
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.ffn_dim is not None and int(self.ffn_dim) < 1:
            raise ValueError(f"ffn_dim must be >= 1, got {self.ffn_dim}")
        if self.item_dim is not None:
            check_item_dim(self.model, self.item_dim, self.d)
        if self.clipping not in CLIPPING_METHODS:
            raise ValueError(f"clipping must be one of {CLIPPING_METHODS}, got {self.clipping!r}")

    def can_start_from_release(self) -> bool:
        """Whether the model can start from the item-transition release: a tied d-wide item table and a final
        LayerNorm (`item_table.start_from_item_table`)."""
        return (self.model in ("dpformer", "transformer") and (self.item_dim or self.d) == self.d
                and self.norm == "pre" and self.d >= 2)

    def item_start(self) -> str:
        """The item table's start this config runs with: `item_init`, with "auto" resolved to "transitions" for a
        private run of a model that can start from the release (on Amazon Games at ε = 8 it takes DPFormer from the
        popularity level, 1.14% test NDCG@10, to 1.69-1.72%: benchmarks/seqrec/README.md), else "random". An "auto"
        start whose releases cannot fit in their share of ε (small ε; public quantities only) runs from a random
        start (`releases.privacy_setup`; the report lists the releases that were made)."""
        if self.item_init != "auto":
            return self.item_init
        return "transitions" if self.epsilon is not None and self.can_start_from_release() else "random"

    def uses_transition_prior(self) -> bool:
        """`transition_prior`, with None resolved to on for a run that starts from the release (`item_start`) with
        a full softmax. (An "auto" start whose releases do not fit in ε runs without either: `releases`.)"""
        if self.transition_prior is not None:
            return self.transition_prior
        return self.item_start() == "transitions" and not self.negatives

    def dropout_rate(self, prior: bool) -> float:
        """`dropout`, with None resolved by the run's start: PRIOR_DROPOUT where it adds the transition prior (`prior`,
        as `releases.uses_transition_prior` resolves it), else DROPOUT (the paper's)."""
        if self.dropout is not None:
            return float(self.dropout)
        return PRIOR_DROPOUT if prior else DROPOUT

    def item_init_epsilon_share(self) -> float:
        """The share of ε the item releases alone spend when `item_init_noise` is None (a public rule): most of it
        with the transition prior (PRIOR_EPSILON_SHARE), half without (ITEM_INIT_EPSILON_SHARE)."""
        return PRIOR_EPSILON_SHARE if self.uses_transition_prior() else ITEM_INIT_EPSILON_SHARE


__all__ = ["DEFAULT_WINDOWS", "DROPOUT", "ITEM_INITS", "ITEM_INIT_EPSILON_SHARE", "NEGATIVE_SAMPLERS", "OPTIMIZERS",
           "PRIOR_DROPOUT", "PRIOR_EPSILON_SHARE", "TrainConfig"]
