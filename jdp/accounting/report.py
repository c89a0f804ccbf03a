"""Releases and the PrivacyReport: what a run published, under which neighbouring relation, and its ε from
dp_accounting."""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from dp_accounting import dp_event as dpe

from jdp.accounting.events import (ADD_OR_REMOVE_ONE, REPLACE_ONE, Relation, _contains, check_relation, compute_epsilon,
                                   describe_relation, gaussian_event, make_accountant)
from jdp.validation import check_delta, check_positive, large_epsilon_warning

NONPRIVATE_TUNING = ("hyper-parameters chosen non-privately on validation data: that choice is not "
                     "accounted in epsilon")


@dataclasses.dataclass(frozen=True)
class Restatement:
    """A release described under another neighbouring relation, to compare mechanisms accounted natively
    under different ones: `event`, composed by `accountant` under dp_accounting's `accounted_under`
    relation (default: `relation` itself), bounds the release's privacy loss under `relation`. E.g. a
    Poisson-sampled Gaussian (native: add/remove, sensitivity C) restated under replace-one is the same
    event under PLD REPLACE_ONE, whose pair is the mixture shifted by ±C, i.e. outputs 2C apart."""
    relation: Relation
    event: dpe.DpEvent
    accountant: str = "rdp"
    accounted_under: Relation | None = None

    def __post_init__(self):
        object.__setattr__(self, "relation", check_relation(self.relation))
        under = self.relation if self.accounted_under is None else check_relation(self.accounted_under)
        object.__setattr__(self, "accounted_under", under)


@dataclasses.dataclass(frozen=True)
class Release:
    """One release: what was published, its event under `relation`, its L2/L1 sensitivity under that
    relation, noise scale (std), and optional restatements under other relations."""
    name: str
    event: dpe.DpEvent
    sensitivity: float | None = None
    noise_scale: float | None = None
    count: int = 1  # number of identical releases (self-composed)
    relation: Relation = ADD_OR_REMOVE_ONE
    restated: tuple[Restatement, ...] = ()

    def composed_event(self, event: dpe.DpEvent | None = None) -> dpe.DpEvent:
        event = self.event if event is None else event
        return event if self.count == 1 else dpe.SelfComposedDpEvent(event, self.count)

    def under(self, relation: Relation) -> tuple[dpe.DpEvent, str | None, Relation] | None:
        """(composed event, accountant or None for the report's, relation to account it under) describing
        this release under `relation`; None when it has no description there. A non-private release is
        non-private under every relation."""
        if relation is self.relation or _contains(self.event, dpe.NonPrivateDpEvent):
            return self.composed_event(), None, self.relation
        for r in self.restated:
            if r.relation is relation:
                return self.composed_event(r.event), r.accountant, r.accounted_under
        return None


@dataclasses.dataclass
class PrivacyReport:
    """Ledger of every release of a private computation and their composed (ε, δ).

    `unit` names the privacy unit (e.g. "user"), `relation` the neighbouring relation between datasets
    that differ in one unit (a dp_accounting NeighboringRelation; add/remove by default) under which
    every release is stated and composed. `assumptions` lists what the guarantee takes as public or
    leaves out (a public item catalogue, declared sizes, hyper-parameters chosen non-privately): the ε
    holds only under them.
    """
    delta: float
    unit: str = "user"
    relation: Relation | str = ADD_OR_REMOVE_ONE
    accountant: str = "rdp"
    releases: list[Release] = dataclasses.field(default_factory=list)
    assumptions: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        check_delta(self.delta)
        self.relation = check_relation(self.relation)
        for r in self.releases:
            self._check_same_relation(r.relation, r.name)

    def _check_same_relation(self, relation: Relation, what: str) -> None:
        if relation is not self.relation:
            raise ValueError(f"{what} is stated under {relation.name} but this report composes under "
                             f"{self.relation.name}: describe it under {self.relation.name} (a Restatement) "
                             f"or keep it in its own report")

    def add(self, name: str, event: dpe.DpEvent, sensitivity: float | None = None,
            noise_scale: float | None = None, count: int = 1, relation: Relation | str | None = None,
            restated: Sequence[Restatement] = ()) -> "PrivacyReport":
        """Records `count` releases of `event`, stated under `relation` (default and only allowed value:
        the report's), with optional restatements under other relations."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        relation = self.relation if relation is None else check_relation(relation)
        self._check_same_relation(relation, f"release {name!r}")
        self.releases.append(Release(name, event, None if sensitivity is None else float(sensitivity),
                                     None if noise_scale is None else float(noise_scale), int(count),
                                     relation, tuple(restated)))
        return self

    def add_release(self, release: Release) -> "PrivacyReport":
        """Records an existing Release (e.g. from another report) after checking its relation."""
        self._check_same_relation(release.relation, f"release {release.name!r}")
        self.releases.append(release)
        return self

    def extend(self, other: "PrivacyReport") -> "PrivacyReport":
        """Adds another report's releases and assumptions (same unit and relation only)."""
        if other.unit != self.unit:
            raise ValueError(f"cannot compose a report on unit {other.unit!r} into one on unit {self.unit!r}")
        self._check_same_relation(other.relation, "the other report")
        for r in other.releases:
            self.add_release(r)
        for a in other.assumptions:
            self.assume(a)
        return self

    def assume(self, text: str) -> "PrivacyReport":
        """Records an assumption the guarantee rests on (once; e.g. NONPRIVATE_TUNING)."""
        if text not in self.assumptions:
            self.assumptions.append(str(text))
        return self

    def add_gaussian(self, name: str, sensitivity: float, noise_std: float, count: int = 1) -> "PrivacyReport":
        """Records `count` Gaussian releases of a statistic with L2 sensitivity (under the report's
        relation) and noise std."""
        sensitivity, noise_std = check_positive(sensitivity, "sensitivity"), check_positive(noise_std, "noise_std")
        return self.add(name, gaussian_event(noise_std / sensitivity), sensitivity, noise_std, count)

    def event(self) -> dpe.DpEvent:
        return dpe.ComposedDpEvent([r.composed_event() for r in self.releases])

    def epsilon(self, delta: float | None = None) -> float:
        if not self.releases:
            return 0.0
        return compute_epsilon(self.event(), self.delta if delta is None else delta, self.accountant,
                               relation=self.relation)

    def _parts_under(self, relation: Relation) -> tuple[list, str, Relation] | None:
        parts = [r.under(relation) for r in self.releases]
        if any(p is None for p in parts):
            return None
        ways = {(acct or self.accountant, under) for _, acct, under in parts}
        if len(ways) != 1:
            raise ValueError(f"the releases' descriptions under {relation.name} need different accountants or "
                             f"relations ({sorted((a, u.name) for a, u in ways)}); they cannot be composed")
        (acct, under), = ways
        return [e for e, _, _ in parts], acct, under

    def epsilon_by_relation(self, relations: Sequence[Relation | str] = (ADD_OR_REMOVE_ONE, REPLACE_ONE),
                            delta: float | None = None) -> dict[Relation, float | None]:
        """{relation: ε at δ} from each release's event under that relation (its own or a Restatement),
        by dp_accounting; None where some release has no description under it."""
        delta = self.delta if delta is None else check_delta(delta)
        out: dict[Relation, float | None] = {}
        for rel in map(check_relation, relations):
            got = self._parts_under(rel) if self.releases else ([], self.accountant, rel)
            if got is None:
                out[rel] = None
            else:
                events, acct, under = got
                out[rel] = compute_epsilon(dpe.ComposedDpEvent(events), delta, acct, relation=under) if events else 0.0
        return out

    def pure_epsilon(self) -> float | None:
        """Σ ε over releases when every release is pure ε-DP (basic composition), else None."""
        total = 0.0
        for r in self.releases:
            if not isinstance(r.event, dpe.RandomizedResponseDpEvent) or r.event.num_buckets != 2:
                return None
            p = r.event.noise_parameter
            total += r.count * math.log((1 - p / 2) / (p / 2))
        return total

    def to_dict(self) -> dict:
        out = {
            "unit": self.unit,
            "neighbouring_relation": self.relation.name.lower(),
            "relation_text": describe_relation(self.relation, self.unit),
            "accountant": type(make_accountant(self.event() if self.releases else None, self.accountant,
                                               relation=self.relation)).__name__,
            "delta": self.delta,
            "epsilon": self.epsilon(),
            "pure_epsilon": self.pure_epsilon(),
            "assumptions": list(self.assumptions),
            "releases": [
                {"name": r.name, "event": repr(r.event), "relation": r.relation.name.lower(),
                 "sensitivity": r.sensitivity, "noise_scale": r.noise_scale, "count": r.count,
                 "restated_under": [s.relation.name.lower() for s in r.restated]}
                for r in self.releases
            ],
        }
        note = large_epsilon_warning(out["epsilon"], self.unit)
        if note is not None:  # ε > jdp.validation.LARGE_EPSILON: accepted, said beside the number
            out["warnings"] = [note]
        if any(r.restated for r in self.releases):
            by = self.epsilon_by_relation()
            out["epsilon_by_relation"] = {rel.name.lower(): eps for rel, eps in by.items()}
            out["epsilon_by_relation_accountant"] = {
                rel.name.lower(): (None if got is None else got[1])
                for rel, got in ((rel, self._parts_under(rel)) for rel in by)}
        return out

    def __str__(self) -> str:
        lines = [f"PrivacyReport: unit={self.unit} ({describe_relation(self.relation, self.unit)}), "
                 f"delta={self.delta:g}"]
        for r in self.releases:
            sens = "-" if r.sensitivity is None else f"{r.sensitivity:.4g}"
            noise = "-" if r.noise_scale is None else f"{r.noise_scale:.4g}"
            lines.append(f"  {r.name:<32} x{r.count:<4} sens={sens:<10} noise={noise:<10} {type(r.event).__name__}")
        total = self.epsilon()
        lines.append(f"  total epsilon = {total:.4f}")
        note = large_epsilon_warning(total, self.unit)
        if note is not None:
            lines.append(f"  WARNING: {note}")
        if any(r.restated for r in self.releases):
            for rel, eps in self.epsilon_by_relation().items():
                lines.append(f"  epsilon under '{describe_relation(rel, self.unit)}': "
                             + ("not defined" if eps is None else f"{eps:.4f}"))
        lines += [f"  assumes: {a}" for a in self.assumptions]
        return "\n".join(lines)
