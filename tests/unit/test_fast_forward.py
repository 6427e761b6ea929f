"""Skipping repeated periods of a replay (analyzer.simulate.requests) changes nothing in its result: the peaks and
the first failure are those of feeding every request, on runs that repeat and on runs that do not settle; and it
does skip where a run repeats from the same allocator state."""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace

import numpy as np
import pytest

from analyzer.attribute import attribute
from analyzer.core.allocator_rules import SMALL_SIZE
from analyzer.diagnose.counterfactual import Replayer, replay, transform_for
from analyzer.ingest import load
from analyzer.simulate.allocator import AllocatorSettings, CachingAllocator
from analyzer.simulate.device import DeviceMemory
from analyzer.simulate.requests import ALLOC, Requests, feed
from tests.support.paths import REAL, ROOT
from tests.support.snapshots import MiB


def steps(count: int, growth: int = 0, released: bool = False, growing: range | None = None) -> Requests:
    """`count` training steps: parameters made once, then each step's activations (freed in reverse), a
    temporary per layer and a gradient kept to the step's end; `growth` bytes more each step (no two alike), in
    the steps of `growing` only where it is given; `released`: the cache emptied at the end of each step
    (torch.cuda.empty_cache())."""
    at, until, size = [-1.0, -1.0], [np.inf, np.inf], [64 * MiB, 3 * MiB]
    releases = []
    position = 0.0
    for step in range(count):
        made = []
        for layer in range(12):
            at.append(position)
            until.append(np.nan)
            size.append((6 + layer % 3) * MiB + (step * growth if growing is None or step in growing else 0))
            made.append(len(at) - 1)
            at.append(position + 0.5)
            until.append(position + 0.7)
            size.append(SMALL_SIZE // 2 + 512 * layer)
            position += 1
        for row in reversed(made):
            until[row] = position
            at.append(position + 0.2)
            until.append(position + 200.5 - (position % 200))
            size.append(2 * MiB)
            position += 1
        position = (position // 200 + 1) * 200
        releases.append(position + 0.6)   # after the step's last frees
    return Requests.of(np.array(at), np.array(until), np.array(size), np.zeros(len(at), dtype=np.int64),
                       np.array(releases if released else []))


def both(requests: Requests, capacity: int | None, settings: AllocatorSettings = AllocatorSettings()):
    fast = feed(CachingAllocator(DeviceMemory(capacity), settings, record=False), requests, fast_forward=True)
    slow = feed(CachingAllocator(DeviceMemory(capacity), settings, record=False), requests, fast_forward=False)
    return fast, slow


def outcome(fed):
    return fed.peak_allocated, fed.peak_reserved, fed.oom_at


@pytest.mark.parametrize("settings", [AllocatorSettings(), AllocatorSettings(expandable_segments=True),
                                      AllocatorSettings(roundup_power2_divisions={"1": 4, "2": 4, "4": 8})])
def test_a_repeating_run_is_skipped_and_predicts_the_same(settings):
    requests = steps(200)
    assert requests.period() is not None
    fast, slow = both(requests, None, settings)
    assert outcome(fast) == outcome(slow)
    assert slow.fed == len(requests.kind) and fast.fed < len(requests.kind) // 10


def test_expandable_ranges_reserved_anew_each_step_are_skipped_and_predict_the_same():
    requests = steps(200, released=True)
    settings = AllocatorSettings(expandable_segments=True)
    fast, slow = both(requests, None, settings)
    assert outcome(fast) == outcome(slow)
    assert slow.fed == len(requests.kind) and fast.fed < len(requests.kind) // 10


def test_states_that_differ_only_by_where_their_ranges_lie_are_equal():
    """A cache emptied every step unmaps a pool's range wholly, and the next step reserves a new one at fresh
    addresses: the states repeat but for where the ranges lie, so they name a block by its range's rank and its
    offset in it (the real-derived expandable case at 1M: 9,940 of 531,258 events fed, was every one)."""
    settings = AllocatorSettings(expandable_segments=True)
    one, other = (CachingAllocator(DeviceMemory(None), settings, record=False) for _ in range(2))
    other.free(other.malloc(512))
    other.empty_cache()                                 # its first range came and went: the next lie higher
    for model in (one, other):
        feed(model, steps(3, released=True), fast_forward=False)
    lowest = [min(b.expandable.addr for b in (*m.small.unmapped, *m.large.unmapped) if b.expandable) for m in (one, other)]
    assert lowest[0] < lowest[1] and one.state() == other.state()
    mixed = CachingAllocator(DeviceMemory(None), AllocatorSettings(), record=False)
    mixed.malloc(4 * MiB)
    assert mixed.state()[0][0][0] == (-1, mixed.active.copy().pop().addr)   # a plain segment: its address


def test_a_run_that_fails_part_way_fails_at_the_same_request():
    requests = steps(200)
    slow = feed(CachingAllocator(DeviceMemory(None), AllocatorSettings(), record=False), requests, fast_forward=False)
    capacity = slow.peak_reserved - 20 * MiB          # not enough for the run's peak: the first failure moves
    fast, short = both(requests, capacity)
    assert short.oom_at is not None and outcome(fast) == outcome(short)


def cut(requests: Requests, events: int) -> Requests:
    """The run stopped after its first `events` events (what it made later is never made, nor freed)."""
    return replace(requests, kind=requests.kind[:events], ordinal=requests.ordinal[:events],
                   position=requests.position[:events])


def _stopped_within_a_period() -> tuple[Requests, Requests]:
    """steps(200) stopped at a period's start (150 periods in) and half a period after it."""
    whole = steps(200)
    period = whole.period()
    assert period is not None
    boundary = period.first + 150 * period.length
    return cut(whole, boundary), cut(whole, boundary + period.length // 2)


def test_a_last_partial_period_that_repeats_the_one_before_is_skipped_too():
    at_boundary, within = _stopped_within_a_period()
    fast, slow = both(within, None)
    assert outcome(fast) == outcome(slow) and slow.fed == len(within.kind)
    assert fast.fed == both(at_boundary, None)[0].fed     # not one event of the half period is fed


def test_a_last_partial_period_that_differs_is_fed():
    at_boundary, within = _stopped_within_a_period()
    last = int(within.ordinal[np.flatnonzero(within.kind == ALLOC)[-1]])
    size = within.size.copy()
    size[last] += 64 * MiB                             # its last allocation is larger than the one a period before
    changed = replace(within, size=size)
    fast, slow = both(changed, None)
    assert outcome(fast) == outcome(slow) and fast.fed > both(at_boundary, None)[0].fed
    assert fast.peak_allocated > both(within, None)[1].peak_allocated     # the change shows in the peak


def test_a_run_that_never_repeats_is_fed_whole():
    requests = steps(200, growth=512 * 1024)          # each step's activations are larger than the last's
    fast, slow = both(requests, None)
    assert outcome(fast) == outcome(slow) and fast.fed == slow.fed == len(requests.kind)


def test_a_run_whose_middle_does_not_repeat_is_skipped_from_a_quarter_in():
    """300 steps whose middle 40 each differ (as where gradient accumulation's two copies of a run meet): the
    period is looked for a quarter in, the repeating parts are skipped, the middle fed, and the peaks are the same."""
    requests = steps(300, growth=512 * 1024, growing=range(130, 170))
    period = requests.period()
    assert period is not None and period.length == len(steps(2).kind) - len(steps(1).kind)
    fast, slow = both(requests, None)
    assert outcome(fast) == outcome(slow) and slow.fed == len(requests.kind) and fast.fed < len(requests.kind) // 3


def _make_real():
    spec = importlib.util.spec_from_file_location("make_real_snapshot", ROOT / "benchmarks" / "make_real_snapshot.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not REAL.is_dir(), reason="../shared/real (the real recordings) is absent")
def test_every_remedy_replay_of_a_repeated_real_recording_skips_and_predicts_the_same(tmp_path):
    """magma27's recording (CS336, allocator settings) repeated 6 times: every transform's replay, with and
    without skipping, gives the same Prediction, and most of them skip."""
    import pickle
    path = tmp_path / "repeated.pickle"
    path.write_bytes(pickle.dumps(_make_real().make("small", 30_000)))
    trace = attribute(load(path))
    replayer = Replayer(trace, 0, 80 << 30, {})
    assert replayer.stream is not None
    skipped = 0
    for remedy in ("micro_batch", "gradient_accumulation", "bf16", "optimizer_8bit", "optimizer_offload",
                   "expandable_segments"):
        if not replayer.can(remedy, None):
            continue
        made = transform_for(remedy, None, {})
        assert made is not None
        changed = made[0](replayer.stream)
        settings = AllocatorSettings(**{**vars(replayer.settings), "expandable_segments": made[1]})
        assert replay(changed, replayer.usable, settings) == replay(changed, replayer.usable, settings, False)
        rows = changed.rows[changed.rows["bytes"] > 0]
        requests = Requests.of(rows["at"].to_numpy(dtype=np.float64), rows["until"].to_numpy(dtype=np.float64),
                               rows["bytes"].to_numpy(), rows["stream"].to_numpy(), changed.releases)
        fast, slow = both(requests, replayer.usable, settings)
        assert outcome(fast) == outcome(slow)
        skipped += fast.fed < slow.fed
    assert skipped >= 3
