"""MkDocs hooks: the pandas tables reference is generated from the code, and the example reports are published.

`<!-- columns: NAME -->`, alone on a line of a page, becomes a Markdown table of that table's columns: name, dtype and the
meaning the code gives it (the comment beside the column in its definition). NAME is one of `TABLES` in
analyzer.core.trace, `timeline`, `spans` or `kernels`. An unknown NAME fails the build. `<!-- remedies -->` becomes
the table of the remedy registry (analyzer.diagnose.remedies.REMEDIES): each remedy's id, what its replay and
plan give it, and its estimate in words.
"""
from __future__ import annotations

import inspect
import re
from pathlib import Path
from types import SimpleNamespace

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

MARKER = re.compile(r"^<!-- columns: (\w+) -->$", re.MULTILINE)
REMEDIES_MARKER = re.compile(r"^<!-- remedies -->$", re.MULTILINE)
ENTRY = re.compile(r'^\s*"(\w+)":\s*"\w+",?\s*(?:#:?\s*(.*))?$')
ROOT = Path(__file__).resolve().parents[2]


def _definitions() -> dict[str, tuple[object, str, dict[str, str]]]:
    """name -> (module, variable, {column: dtype}), straight from the code (importing analyzer never imports torch)."""
    from analyzer.core import timeline, trace
    from analyzer.ingest import kineto, nsys

    by_id = {id(v): k for k, v in vars(trace).items() if k.endswith("_COLUMNS")}
    out = {name: (trace, by_id[id(spec)], spec) for name, spec in trace.TABLES.items()}
    empty = timeline.build_timeline(SimpleNamespace(device_ids=[]))
    out["timeline"] = (timeline, "TIMELINE_COLUMNS", {c: str(t) for c, t in empty.dtypes.items()})
    out["spans"] = (kineto, "SPAN_COLUMNS", kineto.SPAN_COLUMNS)
    out["kernels"] = (nsys, "GPU_ACTIVITY_COLUMNS", nsys.GPU_ACTIVITY_COLUMNS)
    return out


def _comments(module: object, variable: str) -> tuple[str, dict[str, str]]:
    """The `#:` line above a column definition, and the comment beside each of its columns."""
    lines = inspect.getsource(module).splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"{variable}\b.*=", line))
    doc = lines[start - 1].lstrip("#: ").strip() if lines[start - 1].startswith("#:") else ""
    meanings = {}
    for line in lines[start + 1:]:
        if line.startswith(("}", "]")):
            break
        match = ENTRY.match(line)
        if match:
            meanings[match[1]] = (match[2] or "").strip()
    return doc, meanings


def _table(name: str, definitions: dict) -> str:
    if name not in definitions:
        raise PluginError(f"<!-- columns: {name} -->: no such table (known: {', '.join(definitions)})")
    module, variable, spec = definitions[name]
    doc, meanings = _comments(module, variable)
    doc = (doc[:1].upper() + doc[1:]).rstrip(".") + "." if doc else ""
    rows = [f"{doc} Defined by `{module.__name__}.{variable}`.".strip(), "",
            "| column | dtype | meaning |", "|---|---|---|"]
    for column, dtype in spec.items():
        meaning = meanings.get(column, "").replace("|", "\\|")
        rows.append(f"| `{column}` | `{dtype}` | {meaning} |")
    return "\n".join(rows)


def remedies_table() -> str:
    """One row a registered remedy: its id, whether a replay or the plan predicts it, its estimate in words."""
    from analyzer.diagnose.remedies import REMEDIES

    rows = ["| id | replayed | in the plan | estimate on this run |", "|---|---|---|---|"]
    for r in REMEDIES:
        lever = f"`{r.plan.lever}` lever" if r.plan is not None else ""
        rows.append(f"| `{r.id}` | {'yes' if r.replay is not None else ''} | {lever} | {r.docs.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if REMEDIES_MARKER.search(markdown):
        markdown = REMEDIES_MARKER.sub(lambda m: remedies_table(), markdown)
    if not MARKER.search(markdown):
        return markdown
    definitions = _definitions()
    return MARKER.sub(lambda m: _table(m[1], definitions), markdown)


def on_files(files, config):
    """Publish the example reports (reports/*.html, *.pdf, *.png) under reports/ so the guide can link them."""
    for path in sorted((ROOT / "reports").glob("*")):
        if path.suffix in (".html", ".pdf", ".png"):
            files.append(File.generated(config, f"reports/{path.name}", abs_src_path=str(path)))
    return files
