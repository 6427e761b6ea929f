"""Where the time of one `analyze FILE --format json` goes, stage by stage, in CPU seconds of this process (so
that other work on a shared machine does not count): imports, reading (the confined unpickle and the columns),
attribution, measuring, the remedies' transforms and replays, the rest of the diagnosis, and writing the JSON.
The reader runs in a child process (analyzer.ingest.confined), whose CPU time is counted once it is reaped.

    python benchmarks/stages.py FILE
"""
from __future__ import annotations

import os
import sys


def cpu() -> float:
    """CPU seconds of this process and of its reaped children (the confined reader)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


start = cpu()
import analyzer  # noqa: E402  (the imports are a stage of their own)
from analyzer import pipeline  # noqa: E402
from analyzer.diagnose import counterfactual  # noqa: E402

spent: dict[str, float] = {"imports": cpu() - start}


def timed(stage: str, owner: object, name: str) -> None:
    """Count the CPU time of owner.name (outermost calls only) towards `stage`."""
    original = getattr(owner, name)
    depth = [0]

    def wrapper(*args, **kwargs):
        depth[0] += 1
        begin = cpu()
        try:
            return original(*args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                spent[stage] = spent.get(stage, 0.0) + cpu() - begin
    setattr(owner, name, wrapper)


timed("attribution", pipeline, "attribute")
timed("measuring", pipeline, "measure")
timed("diagnosis (all)", pipeline, "diagnose")
timed("remedy transforms", counterfactual.Replayer, "can")
timed("remedy replays", counterfactual, "replay")
timed("reading (confined)", pipeline, "load")


def main() -> None:
    path = sys.argv[1]
    begin = cpu()
    result = analyzer.analyze(path)
    spent["analyze() in all"] = cpu() - begin
    begin = cpu()
    result.to_json_text()
    spent["writing the JSON"] = cpu() - begin
    spent["process"] = cpu() - start
    for stage, seconds in spent.items():
        print(f"{stage:<24} {seconds:7.2f} s")


if __name__ == "__main__":
    main()
