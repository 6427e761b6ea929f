"""What every HTML page of ours shares (a recording's report, a log's, the run log's): the Jinja environment with
its filters and the report's CSS, and the two label formats the filters use. Apart from analyzer.report.html so
that a log's page imports no recording's view (pandas)."""
from __future__ import annotations

from pathlib import Path

import jinja2

from analyzer.core.log_records import gpu_name
from analyzer.core.units import human_bytes


def reserved(n: int | None) -> str:
    """`12.00 GiB reserved`, or that the input does not record it (a memory timeline, a 2021 profiler trace)."""
    return "reserved not recorded" if n is None else f"{human_bytes(n)} reserved"


def words(name: str) -> str:
    """Our own labels (categories, phases, finding kinds) read with spaces: `optimizer_state` -> `optimizer state`."""
    return name.replace("_", " ")


class _Compiled(jinja2.FileSystemBytecodeCache):
    """Jinja's cache of compiled templates (a directory of this user's that only they can write, checked by
    Jinja): compiling the report's template took 0.15-0.27 s of every HTML report. A cache that cannot be written
    is no error: the template is compiled again next time."""

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            super().dump_bytecode(bucket)
        except OSError:
            pass


def _compiled() -> jinja2.BytecodeCache | None:
    try:
        return _Compiled()
    except (OSError, RuntimeError):   # no private temporary directory to be had: compile every time
        return None


#: the reports' Jinja templates, with their filters (shared by the run log's page)
TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("analyzer.report", "templates"),
    autoescape=True,  # every string from an input file is escaped
    undefined=jinja2.StrictUndefined,
    bytecode_cache=_compiled(),
)
TEMPLATES.filters["bytes"] = human_bytes
TEMPLATES.filters["reserved"] = reserved
TEMPLATES.filters["pct"] = lambda share: f"{share:.1%}" if share < 0.1 else f"{share:.0%}"
TEMPLATES.filters["label"] = words
TEMPLATES.filters["gpu"] = gpu_name
TEMPLATES.filters["onoff"] = lambda flag: {True: "on", False: "off"}.get(flag, "not recorded")

REPORT_CSS = (Path(__file__).parent / "templates" / "report.css").read_text(encoding="utf-8")
