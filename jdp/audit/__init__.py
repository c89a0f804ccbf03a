"""Privacy auditing: empirical lower bounds on ε from canaries, beside the ε each routine reports.

A private routine's report states an upper bound on its privacy loss, derived on paper. An audit runs the
routine as implemented on canaries (inputs whose presence the auditor controls and tries to detect) and turns the
attacker's success into a lower bound on ε at a stated confidence (`jdp.audit.bounds`). A lower bound above the
reported ε shows a bug (in the code, the analysis or the accounting); one below it proves nothing, since the
attack may be weak. Each auditor takes deliberately broken variants too, to show that it can fail.

* `bounds`     — the statistics: Steinke–Nasr–Jagielski one-run bound, Clopper–Pearson many-run bound.
* `dp_sgd`     — DP-SGD (`jdp.clipping`): white-box gradient canaries, black-box input canaries, the crafted
                 float32-cancellation canary; variants "no-clip", "half-noise", "old-engine".
* `selection`  — every selection mechanism: exact log-ratios of `probabilities` on worst-case neighbours and a
                 sampled audit of `select`; variants "half-noise", "monotone-misdeclared" (and the non-private RNMH).
* `altmin`     — DP alternating minimization (`jdp.altmin.fit`): canary users; variant "no-noise".

Benchmark: `python -m benchmarks.privacy.audit` (table in benchmarks/privacy/README.md); method and limits in
docs/privacy.md (section "Auditing").
"""
from jdp.audit.altmin import audit_altmin
from jdp.audit.bounds import (AuditResult, RoutineAudit, clopper_pearson_lower, clopper_pearson_upper,
                              many_run_audit, one_run_audit, one_run_epsilon_lower_bound, one_run_p_value)
from jdp.audit.dp_sgd import DPSGDAuditConfig, audit_dp_sgd, old_engine_available
from jdp.audit.selection import exact_audit, sampled_audit

__all__ = ["AuditResult", "DPSGDAuditConfig", "RoutineAudit", "audit_altmin", "audit_dp_sgd",
           "clopper_pearson_lower", "clopper_pearson_upper", "exact_audit", "many_run_audit", "old_engine_available",
           "one_run_audit", "one_run_epsilon_lower_bound", "one_run_p_value", "sampled_audit"]
