"""The cheapest combination of remedies whose predicted peak fits: a search over the remedy lattice in the
method's cost order (USER-STORIES.md "Fix order"), for when one change is not enough.

A lever is one variable practitioners change (micro-batch with accumulation, precision, checkpointing, the
optimizer, the ZeRO stage, the tensor and pipeline degrees, offload); its levels run cheapest first, the first
being the run as it is (cost 0). A configuration takes one level of each lever and costs the sum of its
levels' costs (`COST`, in the method's order; a recording's `RECORDING_COST` follows its remedy list, so that
its plan and its list name the same try-first). The lattice is small (thousands of configurations), so every
valid one is predicted by the caller's formula and the cheapest that fits is the plan, ties going to the lower
peak. The plan makes its changes one at a time, cheapest first, each step with the peak predicted after it:
only the last step fits, since a fitting prefix would be a cheaper configuration. The alternatives are the
next cheapest fitting configurations that are not the plan with more changes added, each with what it costs.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from analyzer.core.vocabulary import RemedyId
from analyzer.diagnose.counterfactual import Prediction, Replayer
from analyzer.diagnose.remedies import (
    BY_ID,
    FIT_HEADROOM,
    LAYOUT_ONLY,
    REMEDIES,
    Breakdown,
    Demand,
    LeverName,
    PlanLever,
    Price,
    fits_as_is,
)
from analyzer.result import ListedRemedy, Plan, PlanAlternative, PlanStep

ALTERNATIVES = 3   # fitting configurations shown after the plan

# A micro-batch of at least BUSY_TOKENS tokens keeps a GPU's matmuls large: accumulating more, smaller micro-batches
# then costs little (the micro-batch term's cost a halving), so `analyze estimate`'s plan halves it before
# checkpointing (20-30% more compute), as the method's fix order does (analyzer.Thresholds.busy_tokens tunes it). Below, each halving costs SMALL_HALVING: one is still cheaper than full
# checkpointing, two are dearer.
BUSY_TOKENS = 2048
SMALL_HALVING = 2.0

#: the cost of each change in the method's order (`analyze estimate`): the batch first (each halving), then
#: checkpointing, the optimizer's memory and ZeRO-1, ZeRO-2/3, tensor and pipeline parallelism, offload last
COST = {r.id.value: r.estimate_term.cost for r in REMEDIES if r.estimate_term is not None}


@dataclass(frozen=True)
class Level:
    """One level of a lever: the remedy it is (its id), in words, its cost, its value (k, stage, degree), and what
    it takes from throughput when this level says it better than the remedy's price (a micro-batch's tokens)."""

    id: str
    title: str
    cost: float
    value: Any = None
    throughput: str | None = None

    def price(self) -> dict[str, str]:
        remedy = BY_ID.get(self.id)
        price = remedy.price if remedy is not None and remedy.price is not None else Price("", "", "")
        throughput, communication, code = self.throughput or price.throughput, price.communication, price.code
        if self.value is not None:
            throughput = throughput.replace("k ", f"{self.value} ").replace(
                "(p-1)/(m+p-1)", f"{self.value - 1}/(m+{self.value - 1})")
        return {"throughput": throughput, "communication": communication, "code": code}


@dataclass(frozen=True)
class Lever:
    name: str
    levels: tuple[Level, ...]   # levels[0] is the run as it is


AS_IS = Level("as_is", "as it is", 0.0)
Config = dict[str, Level]       # lever name -> the level chosen
Predict = Callable[[Config], tuple[int, bool]]   # (predicted peak bytes, fits)


def lever(name: str, levels: list[Level], as_is: Level = AS_IS) -> Lever:
    return Lever(name, (as_is, *levels))


def changes(config: Config) -> list[Level]:
    """The levels a configuration changes, cheapest first: the order its steps are taken in."""
    return sorted((level for level in config.values() if level.cost > 0), key=lambda level: level.cost)


def search(levers: list[Lever], predict: Predict, valid: Callable[[Config], bool] = lambda c: True,
           ) -> list[tuple[float, int, Config]]:
    """Every valid configuration that fits, as (cost, predicted peak, configuration), cheapest first."""
    fitting = []
    for choice in itertools.product(*(lv.levels for lv in levers)):
        config = {lv.name: level for lv, level in zip(levers, choice, strict=True)}
        if not valid(config) or not changes(config):
            continue
        peak, fits = predict(config)
        if fits:
            fitting.append((sum(level.cost for level in choice), peak, config))
    fitting.sort(key=lambda item: (item[0], item[1]))
    return fitting


def _more_of(later: Config, earlier: Config) -> bool:
    """`later` is `earlier` with more changes: on every lever `earlier` moves, `later` is there or further."""
    return all(later[name].cost >= level.cost for name, level in earlier.items() if level.cost > 0)


def distinct(fitting: list[tuple[float, int, Config]], limit: int) -> list[tuple[float, int, Config]]:
    """The cheapest fitting configurations none of which is an earlier one with more changes added."""
    out: list[tuple[float, int, Config]] = []
    for item in fitting:
        if any(_more_of(item[2], earlier[2]) for earlier in out):
            continue
        out.append(item)
        if len(out) == limit:
            break
    return out


def steps(config: Config, as_is: Config) -> list[tuple[Level, Config]]:
    """Each change of `config` with the configuration after it, one variable at a time, cheapest first."""
    out, current = [], dict(as_is)
    for level in changes(config):
        name = next(n for n, chosen in config.items() if chosen is level)
        current = {**current, name: level}
        out.append((level, dict(current)))
    return out


def step_json(level: Level, peak: int, reserved: int | None, fits: bool, source: str) -> PlanStep:
    return {"remedy": level.id, "title": level.title, "value": level.value, "predicted_peak_allocated_bytes": peak,
            "predicted_peak_reserved_bytes": reserved, "fits": fits, "source": source, "cost": level.price()}


def alternative_json(config: Config, cost: float, peak: int, plan_cost: float) -> PlanAlternative:
    made = changes(config)
    return {"remedies": [level.id for level in made], "titles": [level.title for level in made],
            "predicted_peak_allocated_bytes": peak, "source": "formula", "extra_cost": round(cost - plan_cost, 2),
            "cost": {level.id: level.price() for level in made}}


# ---- a recording's plan: the levers its offered remedies give, the formula on its breakdown, the replay ----

_BATCH_LEVELS = (2, 4, 8)     # micro-batches per step a batch lever tries
MAX_REPLAYS = 8               # replays of candidate configurations before the plan is given up
# A recording's single changes cost in the order its remedy list ranks them (analyzer.diagnose.remedies.REMEDIES,
# the method's fix order: each spec's `plan.cost`), so that the cheapest single remedy that fits is the cheapest
# one-change plan and the plan never costs more than the list's try-first. At a fragmentation OOM the allocator
# settings lead, as in the list. A deeper batch cut costs its base once per halving.
_PLANNED: dict[str, PlanLever] = {r.id: r.plan for r in REMEDIES if r.plan is not None}
RECORDING_COST = {str(remedy): part.cost for remedy, part in _PLANNED.items()}
LAYOUT_FIRST_COST = {str(remedy): part.layout_first_cost for remedy, part in _PLANNED.items()
                     if part.layout_first_cost is not None}
#: each lever's remedies, in the registry's order, the levers in the order of `LeverName`
_LEVERS = tuple((name.value, tuple(str(remedy) for remedy, part in _PLANNED.items() if part.lever is name))
                for name in LeverName)


def recording_cost(remedy: str, layout_first: bool) -> float:
    return LAYOUT_FIRST_COST[remedy] if layout_first and remedy in LAYOUT_FIRST_COST else RECORDING_COST[remedy]


def listed_value(d: Demand, remedy: str) -> int | None:
    """The level the remedy list's entry is at: 2 micro-batches, the GPUs or stages its title names."""
    part = _PLANNED.get(remedy)
    return None if part is None else part.value(d)


def _batch_title(remedy: str, title: str, k: int) -> str:
    if k == 2:
        return title
    if remedy == RemedyId.GRADIENT_ACCUMULATION:
        return f"Gradient accumulation: {k} micro-batches of 1/{k} the size"
    return f"Divide the batch by {k}" + (" (or the sequence length)" if "sequence" in title else "")


def recording_levers(d: Demand, remedies: list[ListedRemedy]) -> list[Lever]:
    """The levers a recording's offered remedies give, each remedy a level at its place in the list's order. The
    batch lever of a run that trains halves the micro-batch once (the global batch halves) and goes further only
    with accumulation, which keeps the global batch; a forward-only run's batch divides by 2, 4 and 8."""
    offered = {r["id"]: r for r in remedies}
    layout_first = d.oom_verdict == "fragmentation"
    levers = []
    for name, ids in _LEVERS:
        levels: list[Level] = []
        for remedy in (i for i in ids if i in offered and offered[i]["new_peak_bytes"] is not None):
            base, title = recording_cost(remedy, layout_first), str(offered[remedy]["title"])
            if _PLANNED[remedy].divides_batch:
                ks = (2,) if remedy == RemedyId.MICRO_BATCH and RemedyId.GRADIENT_ACCUMULATION in offered else _BATCH_LEVELS
                levels += [Level(remedy, _batch_title(remedy, title, k), base * (k.bit_length() - 1), k) for k in ks]
            else:
                levels.append(Level(remedy, title, base, listed_value(d, remedy)))
        if levels:
            levers.append(lever(name, levels))
    return levers


_PARALLEL = {remedy for remedy, part in _PLANNED.items() if part.lever in (LeverName.ZERO, LeverName.TP, LeverName.PP)}


def _degrees(config: Config) -> int:
    """GPUs a configuration's parallelism takes: ZeRO's, tensor and pipeline degrees multiplied."""
    return math.prod(level.value for level in config.values() if level.id in _PARALLEL)


def formula_peak(d: Demand, config: Config) -> int:
    """The peak after the configuration's changes, on the breakdown of the run's worst moment: each change
    acts on the categories as its remedy's formula says (analyzer.diagnose.remedies), one after the other."""
    breakdown = Breakdown(d.by_category, d.total)
    for level in changes(config):
        formula = _PLANNED[level.id].formula if level.id in _PLANNED else None
        if formula is not None:
            formula(d, breakdown, level.value or 1)
    return int(round(breakdown.total))


def _key(config: Config) -> tuple[tuple[str, Any], ...]:
    return tuple((level.id, level.value) for level in changes(config))


Predicted = tuple[int, int | None, bool, str]   # (peak allocated, peak reserved or None, fits, source)


def _seed(d: Demand, remedies: list[ListedRemedy]) -> tuple[dict[Any, Predicted], dict[Any, Prediction]]:
    """The remedy list's own predictions of its single changes (so that a one-change plan says what the list
    says), and its replays, reused when a change is composed with formula-only ones."""
    singles: dict[Any, Predicted] = {}
    runs: dict[Any, Prediction] = {}
    for r in remedies:
        if r["new_peak_bytes"] is None or r["fits"] is None:
            continue
        key = ((r["id"], listed_value(d, r["id"])),)
        replay = r["replay"]
        if replay is None or replay["oom"] is None:
            singles[key] = (int(r["new_peak_bytes"]), None, bool(r["fits"]), "formula")
            continue
        singles[key] = (int(r["new_peak_bytes"]), int(replay["peak_reserved_bytes"]), bool(r["fits"]), "replay")
        runs[key] = Prediction(int(replay["peak_allocated_bytes"]), int(replay["peak_reserved_bytes"]), bool(replay["oom"]))
    return singles, runs


def for_recording(d: Demand, remedies: list[ListedRemedy], replayer: Replayer | None) -> Plan | None:
    """The plan of a run that does not fit on a known device: the cheapest configuration of its offered remedies
    that fits, single changes as the remedy list predicts them and combinations by their formula, checked by
    replaying the replayable changes composed (the formula's saving of the others taken off the replayed peak);
    the next candidate when the replay says it does not fit, up to MAX_REPLAYS replays. A combination whose fit
    rests on a formula (bf16's is a loose upper bound) gives way to a dearer replayed one, or to a single change
    the list says fits, and is the plan only when neither fits. None for a run that fits, on an unknown device,
    or a leak."""
    if d.capacity is None or fits_as_is(d) or d.triage == "leak" or not remedies:
        return None
    levers = recording_levers(d, remedies)
    capacity = d.capacity
    limit = FIT_HEADROOM * capacity
    cache, runs = _seed(d, remedies)
    seeded, listed_runs = set(cache), len(runs)

    def fits(config: Config, peak: int, oom: bool = False) -> bool:
        layout = any(level.id in LAYOUT_ONLY for level in changes(config))
        return peak <= (capacity if layout else limit) and not oom

    def predicted(config: Config, replay: bool = True) -> Predicted | None:
        """The configuration's prediction; None when it needs a replay and `replay` is off."""
        key = _key(config)
        if key in cache:
            return cache[key]
        made = changes(config)
        replayed = [level for level in made if replayer is not None and replayer.can(level.id, level.value)]
        peak = formula_peak(d, config)
        if not replayed or replayer is None:
            cache[key] = (peak, None, fits(config, peak), "formula")
            return cache[key]
        part = tuple((level.id, level.value) for level in replayed)
        if part not in runs:
            if not replay:
                return None
            runs[part] = replayer.run(list(part))
        run = runs[part]
        only = {name: (level if level in replayed else AS_IS) for name, level in config.items()}
        formula_saving = formula_peak(d, only) - peak if len(replayed) < len(made) else 0
        peak = run.peak_allocated_bytes - formula_saving
        if not formula_saving:
            cache[key] = (peak, run.peak_reserved_bytes, fits(config, peak, bool(run.oom)), "replay")
            return cache[key]
        # the replayed part ran without the formula's saving, so neither its OOM nor its reserve (grown past the
        # device once it failed) speaks for the whole: the allocated peak less that saving is judged, as a formula is
        cache[key] = (peak, None, fits(config, peak), "formula")
        return cache[key]

    # what the list's replay of a single change says beyond its formula, added to a combination's formula to
    # choose the candidates worth replaying (optimizer offload also drops the step's temporaries, which its
    # formula does not count)
    beyond = {(level.id, level.value): cache[((level.id, level.value),)][0] - formula_peak(d, {lv.name: level})
              for lv in levers for level in lv.levels[1:] if cache.get(((level.id, level.value),), ("",) * 4)[3] == "replay"}

    def first_guess(config: Config) -> tuple[int, bool]:
        key = _key(config)
        if key in cache:
            return cache[key][0], cache[key][2]
        peak = max(0, formula_peak(d, config) + sum(beyond.get(change, 0) for change in key))
        return peak, fits(config, peak)

    world = d.world_size
    fitting = search(levers, first_guess, lambda c: world is None or _degrees(c) <= world)
    start = {lv.name: lv.levels[0] for lv in levers}
    searched = math.prod(len(lv.levels) for lv in levers)
    chosen, guessed = None, None
    for cost, _, config in fitting:
        guess = predicted(config, replay=len(runs) - listed_runs < MAX_REPLAYS)
        if guess is None or not guess[2]:
            continue
        if guess[3] == "formula" and len(changes(config)) > 1:
            guessed = guessed or (cost, config)   # a combination resting on a formula: only if none replayed fits
            continue
        chosen = (cost, config)
        break
    picked = chosen or guessed
    if picked is None:
        return {"fits": False, "steps": [], "single": False, "alternatives": [], "searched": searched,
                "replays": replayer.replays if replayer is not None else 0}
    cost, config = picked
    out = [step_json(level, *_at_least(predicted(after))) for level, after in steps(config, start)]
    refuted = {k for k, v in cache.items() if not v[2]}     # the formula said fits, the replay did not
    others = [item for item in distinct([f for f in fitting if _key(f[2]) not in refuted], ALTERNATIVES + 1)
              if item[2] is not config][:ALTERNATIVES]
    return {"fits": True, "steps": out, "single": len(out) == 1 and _key(config) in seeded,
            "alternatives": [alternative_json(c, alt_cost, peak, cost) for alt_cost, peak, c in others],
            "searched": searched, "replays": replayer.replays if replayer is not None else 0}


def _at_least(found: Predicted | None) -> Predicted:
    assert found is not None   # a step's prediction is always made (replay allowed)
    return found


def agree(remedies: list[ListedRemedy], found: Plan | None) -> None:
    """One try-first for the verdict, the list and the plan: when a plan fits, the remedy of its first step. A
    plan of exactly the list's cheapest fitting remedy leaves it as it is; otherwise (no single change fits, or
    changes cheaper together) the remedy of step 1 is marked, with `plan_step` saying it is the plan's first."""
    if not found or not found["fits"]:
        return
    first_step = found["steps"][0]
    chosen = next(r for r in remedies if r["id"] == first_step["remedy"])
    found["cheapest_single"] = next((r["id"] for r in remedies if r["try_first"]), None)
    found["try_first"] = chosen["id"]
    for r in remedies:
        r["try_first"] = r is chosen
    if not found["single"]:
        chosen["plan_step"] = f"the plan's step 1 of {len(found['steps'])}: {first_step['title']}"
