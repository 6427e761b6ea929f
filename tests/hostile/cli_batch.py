"""Run the CLI (`analyzer.commands.analyze.main`) on many files in one process, one JSON line per file on stdout.

    python tests/hostile/cli_batch.py OUT_DIR FILE...

One interpreter start instead of one per file keeps the corpus run short; the caller still bounds it with a
subprocess timeout and a memory limit. Before each file a line {"start": FILE} is printed and flushed, so a
caller whose timeout fires can say which file hung. Each run writes its report as JSON into OUT_DIR, and
reports {"file", "code", "stderr", "warnings", "seconds"}. The EXT payloads' extension codes are registered
first, as an imported library might have done (make_corpus.register_extensions).
"""
from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from pathlib import Path

from make_corpus import register_extensions

from analyzer.commands import main


def run(path: str, out_dir: Path) -> dict:
    out = out_dir / (Path(path).name + ".json")
    stderr = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = main([path, "--format", "json", "-o", str(out), "-q"])
    warnings = json.loads(out.read_text()).get("warnings") if code == 0 and out.exists() else None
    return {"file": path, "code": code, "stderr": stderr.getvalue(), "warnings": warnings,
            "seconds": round(time.perf_counter() - started, 3)}


if __name__ == "__main__":
    register_extensions()
    out_dir = Path(sys.argv[1])
    for path in sys.argv[2:]:
        print(json.dumps({"start": path}), flush=True)
        print(json.dumps(run(path, out_dir)), flush=True)
