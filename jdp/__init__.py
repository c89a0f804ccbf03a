"""jdp: JAX-native differentially private learning on long-tailed data.

Core: `jdp.accounting` (PrivacyReport, calibration), `jdp.noise`, `jdp.metrics`, `jdp.data`.
Capabilities: `jdp.multitask` + `jdp.altmin` (user-level DP recommendation with adaptive weights),
`jdp.clipping` + `jdp.seqrec` (fast per-example clipping, DPFormer), `jdp.selection` (private
selection with heterogeneous sensitivities), `jdp.meta` (task-level DP meta-learning).
"""
from jdp.accounting import PrivacyReport, calibrate, compute_epsilon

__version__ = "0.1.0"
__all__ = ["PrivacyReport", "calibrate", "compute_epsilon", "__version__"]
