"""Privacy accounting over dp_accounting: events, calibration and the PrivacyReport.

Every private routine in jdp describes what it released as `dp_accounting` events and records them in
a `PrivacyReport`. Totals always come from a dp_accounting accountant (RDP by default, PLD where the
events need it), never from hand-derived formulas.

Neighbouring relation: data, not text. Every accountant, ε computation, calibration, release and report
names one of dp_accounting's relations between datasets that differ in one privacy unit (a user, a
task, ...): ADD_OR_REMOVE_ONE (the default), REPLACE_ONE (that unit's data replaced by any other) or
REPLACE_SPECIAL (replaced by a fixed null unit). A noise multiplier is std / sensitivity *under the
event's relation*. Releases of different relations never compose by accident: a report refuses them;
a release may carry `Restatement`s (the same mechanism's event under another relation) so reports can
state ε under several relations side by side (`PrivacyReport.epsilon_by_relation`).

Pure ε-DP releases are represented by their tight dominating pair, binary randomized response with
parameter ε (`pure_dp_event`); those are composed with the PLD accountant under dp_accounting's
REPLACE_ONE relation (RR's loss between two different inputs is exactly ε; an ε-DP mechanism is
ε-indistinguishable for any pair of neighbours of the report's relation, so this dominates it). This holds
for reports under ADD_OR_REMOVE_ONE and REPLACE_SPECIAL alike: under REPLACE_SPECIAL dp_accounting
analyses randomized response against a "special" input whose output is uniform, which is not the worst
case of a general ε-DP mechanism (one ε = 1 selection came out as ε = 0.625, five as 3.10), so a
pure-DP event is never handed to an accountant under that relation.
"""
from jdp.accounting.calibration import calibrate
from jdp.accounting.events import (ADD_OR_REMOVE_ONE, DEFAULT_RDP_ORDERS, REFERENCE_RDP_ORDERS, REPLACE_ONE,
                                   REPLACE_ONE_RDP_ORDERS, REPLACE_SPECIAL, Relation, check_relation, compute_epsilon,
                                   default_orders, describe_relation, epsilons_from_orders, gaussian_event,
                                   make_accountant, pure_dp_event)
from jdp.accounting.report import NONPRIVATE_TUNING, PrivacyReport, Release, Restatement

__all__ = [
    "ADD_OR_REMOVE_ONE", "DEFAULT_RDP_ORDERS", "NONPRIVATE_TUNING", "REFERENCE_RDP_ORDERS", "REPLACE_ONE",
    "REPLACE_ONE_RDP_ORDERS", "REPLACE_SPECIAL", "PrivacyReport", "Relation", "Release", "Restatement", "calibrate",
    "check_relation", "compute_epsilon", "default_orders",
    "describe_relation", "gaussian_event", "make_accountant", "pure_dp_event", "epsilons_from_orders",
]
