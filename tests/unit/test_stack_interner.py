"""The snapshot reader's stack interning (analyzer.ingest.snapshot_history.StackInterner): a new frames list is
compared with the stack predicted from the last three new lists' stacks, else found by its probe. Whichever way a
list is found, its id is the one the probe alone gives; a periodic run is found by prediction after its first
period; frames that are not plain are never compared by `==`."""
from __future__ import annotations

import gc
from array import array
from itertools import repeat
from pathlib import Path

import pytest

import analyzer.ingest.snapshot_history as history
from analyzer.ingest.safe_pickle import load_untrusted
from analyzer.ingest.snapshot_history import CHUNK, MISSING, StackInterner
from analyzer.ingest.sniff import open_input
from tests.support.paths import REAL

SMALL = REAL / "magma27-cs336-a2" / "memory_snapshot.pickle"   # the newest schema, 5,163 entries
CPP = REAL / "wedsonlin-cs336-a2" / "medium_1024_training_memory_snapshot.pickle"   # C++ frames, 22,331 entries
PYTHON = REAL / "zidongliu-decomfl" / "memory.pickle"   # Python frames only, 23,105 entries


def _frame(i: int) -> dict:
    return {"filename": f"/train/model{i % 3}.py", "line": i, "name": f"f{i}"}


def _ids_one_by_one(frame_lists: list) -> list[int]:
    """Each list by its probe alone (`intern`), as the reader found them before prediction."""
    interner = StackInterner()
    return [interner.intern(f) for f in frame_lists]


def _ids_together(frame_lists: list, chunk: int = CHUNK) -> tuple[list[int], int]:
    """The reader's way (`intern_all`, chunk by chunk); and how many lists went to the probe (`_find`)."""
    interner, out, found = StackInterner(), array("q"), [0]
    probe = interner._find

    def counting(frames: object) -> tuple:
        found[0] += 1
        return probe(frames)

    interner._find = counting  # type: ignore[method-assign]
    for start in range(0, len(frame_lists), chunk):
        interner.intern_all(frame_lists[start:start + chunk], out)
    return out.tolist(), found[0]


def _periodic(steps: int) -> list:
    """`steps` training steps of the same 6 stacks in the same order, each entry with a new list of shared
    frame dicts, as torch writes them; a free's two entries share one list; stacks 4 and 5 share their probe."""
    frames = [_frame(i) for i in range(12)]
    stacks = [frames[0:3], frames[3:6], frames[0:5], frames[5:9], [frames[0], frames[9], frames[1], frames[11], frames[2]],
              [frames[0], frames[10], frames[1], frames[11], frames[2]]]
    lists: list = []
    for _ in range(steps):
        for stack in stacks:
            lists.append(list(stack))           # the alloc
            free = list(stack)
            lists += [free, free, None, []]     # free_requested and free_completed, then entries without frames
    return lists


def test_a_periodic_run_is_predicted_after_its_first_period() -> None:
    lists = _periodic(1000)
    ids, found = _ids_together(lists, chunk=997)
    assert ids == _ids_one_by_one(lists)
    assert sorted(set(ids)) == [MISSING, 0, 1, 2, 3, 4, 5]
    # 12,000 new lists of 6 stacks: only the first period's, and one a stack while the three before it repeat,
    # go to the probe (was every one of them)
    assert found <= 2 * 12 + 3 * 6, found


def test_equal_frames_that_are_distinct_objects_are_one_stack() -> None:
    lists = _periodic(50)
    copies = [[dict(f) for f in frames] if frames else frames for frames in lists]   # the same content, new dicts
    ids, _ = _ids_together(lists + copies)
    assert ids == _ids_one_by_one(lists + copies)
    assert ids[len(lists):] == ids[:len(lists)]


def test_frames_that_are_not_plain_are_never_compared_by_eq() -> None:
    """A frame holding a nested value would make `==` walk it (two distinct but equal structures of 2**40 paths
    take hours): such stacks are found by their frames' identities only, and predicted by nothing. Here the
    structures are small, so that a prediction would show as a count, not as a test that never ends."""
    def laughs() -> list:
        level: list = ["x"]
        for _ in range(3):
            level = [level, level]
        return level

    one, two = {**_frame(1), "extra": laughs()}, {**_frame(1), "extra": laughs()}
    lists = [[_frame(0), one] if i % 2 else [_frame(0), two] for i in range(2000)]
    shared = _frame(0)
    for frames in lists:
        frames[0] = shared
    ids, found = _ids_together(lists)
    assert ids == _ids_one_by_one(lists) and len(set(ids)) == 1   # equal content: one stack, found by the probe
    assert found == 2000


def test_a_long_list_met_again_is_known_by_its_id() -> None:
    """A list met again further on (not the entry before's) is a new list to the prediction and the probe, but one
    of more than LONG frames is remembered by its id: a file repeating long lists by reference costs a lookup an
    entry, not a walk of the list; a list of LONG frames is walked."""
    frames = [_frame(i) for i in range(StackInterner.LONG + 1)]
    long = [list(frames), list(reversed(frames))] * 500
    ids, found = _ids_together(long)
    assert ids == _ids_one_by_one(long) and sorted(set(ids)) == [0, 1]
    assert found == 2
    short = [frames[:StackInterner.LONG], frames[1:]] * 500
    ids, found = _ids_together(short)
    assert ids == _ids_one_by_one(short) and sorted(set(ids)) == [0, 1]
    assert found > 2


def test_a_stack_of_a_long_name_is_not_plain() -> None:
    long = "x" * (StackInterner.PLAIN_CHARS + 1)
    assert history._plain([_frame(0), _frame(1)])
    assert not history._plain([_frame(0), {**_frame(1), "name": long}])
    assert not history._plain([_frame(0), {**_frame(1), **{f"k{i}": i for i in range(StackInterner.PLAIN_KEYS)}}])
    assert not history._plain([_frame(0), {**_frame(1), "line": [1]}])
    assert not history._plain((_frame(0),))


@pytest.mark.parametrize("path,probed", [(SMALL, 0.3), (CPP, 0.1), (PYTHON, 0.1)], ids=["magma27", "wedsonlin", "zidongliu"])
def test_real_recordings_get_the_ids_the_probe_gives(path: Path, probed: float) -> None:
    """Measured: 279 of 1,038 new lists went to the probe (one training step and a bit), 1,224 of 14,961 and
    1,405 of 15,495."""
    if not path.exists():
        pytest.skip(f"{path} (a real recording) is absent")
    gc.disable()
    try:
        with open_input(path) as stream:
            data = load_untrusted(stream, str(path))
    finally:
        gc.enable()
    lists = [frames for trace in data["device_traces"] for frames in map(dict.get, trace, repeat("frames"))]
    ids, found = _ids_together(lists)
    assert ids == _ids_one_by_one(lists)
    unique = len({id(f) for f in lists if f})
    assert found < probed * unique, (found, unique)   # the others were predicted
