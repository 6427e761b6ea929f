"""Which logged runs are one change apart, and what that change saved against what the earlier run predicted.

The rule, for each run in the order logged (the *after* run), pairing it with at most one earlier run:
1. its note names remedy ids (`micro_batch`, `activation-checkpointing`: a word of the note, `-` read as `_`):
   the nearest earlier run that offered one of them, and whose own note does not name it (a run again after the
   change is no run before it), is *before*; the prediction is that remedy's, on each device;
2. otherwise, the nearest earlier run with the same devices whose revealed configuration (CONFIG_VARIABLES)
   differs in exactly one variable both runs know (unknown on either side is no difference). The prediction is
   that of the remedy that changes the variable (VARIABLE_REMEDIES: more GPUs is ZeRO or tensor parallelism,
   another precision is bf16), the closest to what was measured when several do; none for the others.
The saving measured on a device is the memory the run needed before less after (its allocated peak, or at an
OOM allocated + the request that failed: what predictions are made against), the reserved peak for the
allocator settings, whose prediction is memory given back to fragmentation (RemedyId.layout_only).
A run is looked for among the PAIR_WINDOW runs logged just before it, so pairing a log of n runs takes time
linear in n (comparing with every earlier run took 570 s for 20,000 runs).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from analyzer.core.vocabulary import RemedyId
from analyzer.report.run_log import CONFIG_VARIABLES, Run

#: config variable -> the remedies that change it (RemedyId.variables, which each remedy's spec reads too)
VARIABLE_REMEDIES = {variable: tuple(r.value for r in RemedyId if variable in r.variables)
                     for variable in dict.fromkeys(v for r in RemedyId for v in r.variables)}
_WORD = re.compile(r"[a-z0-9_]+")
#: earlier runs a run is compared with, the nearest first
PAIR_WINDOW = 100


@dataclass(frozen=True)
class DevicePair:
    """One device of a pair: what it needed and reserved in each run, and the prediction it is checked against."""

    device: int
    rank: int | None
    before: dict[str, Any]
    after: dict[str, Any]
    remedy: dict[str, Any] | None      # the earlier run's remedy on this device (its id, title, saved_bytes, measure)
    how: str | None                    # why that remedy: 'named in the note', 'closest estimate among zero1, zero2'

    @property
    def needed_saving_bytes(self) -> int:
        return int(self.before["needed_bytes"] - self.after["needed_bytes"])

    @property
    def reserved_saving_bytes(self) -> int:
        return int(self.before["peak_reserved_bytes"] - self.after["peak_reserved_bytes"])

    @property
    def measured_saving_bytes(self) -> int:
        """The saving in the measure the remedy's prediction is made in (needed memory unless it is reserved)."""
        reserved = self.remedy is not None and self.remedy["measure"] == "reserved"
        return self.reserved_saving_bytes if reserved else self.needed_saving_bytes

    @property
    def predicted_saving_bytes(self) -> int | None:
        return None if self.remedy is None else int(self.remedy["saved_bytes"])

    @property
    def ratio(self) -> float | None:
        """Measured / predicted: 1.0 is an exact prediction."""
        predicted = self.predicted_saving_bytes
        return self.measured_saving_bytes / predicted if predicted else None


@dataclass(frozen=True)
class Pair:
    before: Run
    after: Run
    change: str                 # 'note names micro_batch', 'gpus 1 -> 4'
    devices: list[DevicePair]


def pair_runs(runs: list[Run]) -> list[Pair]:
    """Every run paired with the earlier run it is one change from, by the rule above."""
    traits = [_Traits.of(r) for r in runs]
    pairs = []
    for j, after in enumerate(runs):
        mine = traits[j]
        earlier = range(j - 1, max(0, j - PAIR_WINDOW) - 1, -1)   # nearest first
        found = next((p for i in earlier if mine.named & (traits[i].offered - traits[i].named)
                      and (p := _by_note(runs[i], after, mine.named)) is not None), None) if mine.named else None
        found = found or next((p for i in earlier if _one_apart(traits[i].config, mine.config)
                               and (p := _by_config(runs[i], after)) is not None), None)
        if found is not None:
            pairs.append(found)
    return pairs


@dataclass(frozen=True)
class _Traits:
    """What pairing compares of a run, read once: the remedy ids its note names and those it offered, and its
    configuration's values in CONFIG_VARIABLES order."""

    named: frozenset[str]
    offered: frozenset[str]
    config: tuple[Any, ...]

    @staticmethod
    def of(run: Run) -> _Traits:
        return _Traits(frozenset(named_remedies(run.record.get("note"))),
                       frozenset(r["id"] for d in run.devices for r in d["remedies"]),
                       tuple(run.config.get(v) for v in CONFIG_VARIABLES))


def _one_apart(before: tuple[Any, ...], after: tuple[Any, ...]) -> bool:
    """Exactly one variable known to both runs differs."""
    return sum(b is not None and a is not None and b != a for b, a in zip(before, after, strict=True)) == 1


def named_remedies(note: str | None) -> set[str]:
    """The words of a note, any of which may be a remedy id."""
    return set(_WORD.findall(note.lower().replace("-", "_"))) if note else set()


def _key(d: dict[str, Any]) -> tuple[int | None, int]:
    return d.get("rank"), d["device"]


def _matched(before: Run, after: Run) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    later = {_key(d): d for d in after.devices}
    return [(d, later[_key(d)]) for d in before.devices if _key(d) in later]


def _by_note(before: Run, after: Run, named: frozenset[str]) -> Pair | None:
    done = named_remedies(before.record.get("note"))   # a run after the change already
    offered = {r["id"] for d in before.devices for r in d["remedies"]} & (named - done)
    matched = _matched(before, after)
    if not offered or not matched:
        return None
    if len(offered) > 1:   # several changes at once: no one remedy's prediction is the one to check
        return Pair(before, after, f"note names {', '.join(sorted(offered))}",
                    [DevicePair(b["device"], b.get("rank"), b, a, None, None) for b, a in matched])
    remedy_id = offered.pop()
    devices = [DevicePair(b["device"], b.get("rank"), b, a,
                          next((r for r in b["remedies"] if r["id"] == remedy_id), None), "named in the note")
               for b, a in matched]
    return Pair(before, after, f"note names {remedy_id}", devices)


def _by_config(before: Run, after: Run) -> Pair | None:
    differ = [v for v in CONFIG_VARIABLES if before.config.get(v) is not None and after.config.get(v) is not None
              and before.config[v] != after.config[v]]
    if len(differ) != 1:
        return None
    matched = _matched(before, after)
    if not matched or len(matched) != len(before.devices) or len(matched) != len(after.devices):
        return None
    variable = differ[0]
    candidates = VARIABLE_REMEDIES.get(variable, ())
    devices = []
    for b, a in matched:
        offered = [r for r in b["remedies"] if r["id"] in candidates]
        bare = DevicePair(b["device"], b.get("rank"), b, a, None, None)
        how = "the remedy that changes it" if len(offered) == 1 else \
            f"closest estimate among {', '.join(r['id'] for r in offered)}"
        chosen = [DevicePair(b["device"], b.get("rank"), b, a, r, how) for r in offered]
        devices.append(min(chosen, key=lambda p: abs(p.measured_saving_bytes - (p.predicted_saving_bytes or 0)))
                       if chosen else bare)
    return Pair(before, after, f"{variable} {before.config[variable]} -> {after.config[variable]}", devices)
