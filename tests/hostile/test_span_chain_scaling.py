"""A Kineto trace with a deep chain of ended python_function spans followed by as many memory events (issue 20):
finding each event's stack must not climb the chain. Measured as Python lines run in the reader at N and 2N."""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

from analyzer.ingest import kineto


def _trace(n: int) -> bytes:
    """n nested calls (call k from t=k to t=2n-k), all ended before n memory events at t >= 3n."""
    calls = [{"ph": "X", "cat": "python_function", "name": f"deep.py({k}): f{k}", "pid": 1, "tid": 1, "ts": k,
              "dur": 2 * n - 2 * k, "args": {"Python id": k + 1, "Python parent id": k or None}} for k in range(n)]
    memory = [{"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1, "ts": 3 * n + j,
               "args": {"Device Type": 1, "Device Id": 0, "Addr": 4096 * (j + 1), "Bytes": 512,
                        "Total Allocated": 512 * (j + 1), "Total Reserved": 1 << 30}} for j in range(n)]
    return json.dumps({"traceEvents": calls + memory}).encode()


def _lines_run(data: bytes) -> int:
    """Lines of analyzer/ingest/kineto.py executed while reading `data`."""
    source = Path(kineto.__file__).resolve()
    count = 0
    ours: dict[str, bool] = {}   # file name -> is the reader's: resolving a path per call would be most of the run

    def tracer(frame, event, arg):
        nonlocal count
        name = frame.f_code.co_filename
        if name not in ours:
            ours[name] = Path(name).resolve() == source
        if not ours[name]:
            return None
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        trace = kineto.parse_chrome_trace(io.BufferedReader(io.BytesIO(data)), "chain.json",
                                          lambda: io.BufferedReader(io.BytesIO(data)))
    finally:
        sys.settrace(None)
    assert len(trace.allocations) > 0 and trace.allocations["stack_id"].isna().all()  # every call had ended
    return count


def test_stack_lookup_is_linear_in_the_chain_and_the_events() -> None:
    small, large = _lines_run(_trace(1000)), _lines_run(_trace(2000))
    print(f"lines run: {small} at N=1000, {large} at 2N")
    assert large <= 2.3 * small


def test_events_inside_the_chain_get_the_innermost_open_call() -> None:
    start = kineto.np.array([0.0, 1.0, 2.0, 10.0])
    end = kineto.np.array([20.0, 9.0, 3.0, 12.0])
    times = kineto.np.array([2.5, 5.0, 11.0, 15.0, 25.0, -1.0])
    assert kineto.innermost_open(start, end, times).tolist() == [2, 1, 3, 0, -1, -1]
