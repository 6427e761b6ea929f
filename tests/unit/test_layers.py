"""The package's layers import only downward, no modules import each other in a circle, and the pairs DESIGN.md
says never import each other ("What never imports what") do not:

    ingest -> diagnose, report       readers know formats, not judgements or outputs
    core -> ingest, commands         the tables do not know where they came from, nor who asked
    attribute -> ingest, diagnose    labels read the tables and the trace's capabilities, never a format's name
    diagnose -> ingest, report       judgement reads tables; findings are data
    report -> ingest, diagnose       reporters render a finished Analysis; they never reopen a file or recompute
    job -> report                    orchestration renders nothing: commands render

The order below is coarser (it lets report import diagnose, for one): the "never" pairs are the contract. The
imports that break a pair today are listed in STILL_CROSSING, each with why; the test fails on any other, and on
a listed one that is gone (the list only shrinks).

    errors < core < ingest, recording < attribute, simulate < result < diagnose, estimate, log_result < report <
    pipeline, job < evaluate, gate, commands < the package's public __init__

Every import counts, those inside functions included (an import deferred for speed is still a dependency).
"""
from __future__ import annotations

import ast
from pathlib import Path

import analyzer

PACKAGE = Path(analyzer.__file__).parent
LAYERS = {
    "analyzer.errors": 0, "analyzer.core": 1, "analyzer.ingest": 2, "analyzer.recording": 2,
    "analyzer.attribute": 3, "analyzer.simulate": 3, "analyzer.result": 4, "analyzer.diagnose": 5, "analyzer.estimate": 5,
    # a log's analysis: read by ingest.log, judged by log_diagnose (apart from diagnose, whose package imports
    # pandas), rendered by report.log_*
    "analyzer.log_diagnose": 5, "analyzer.log_result": 5,
    "analyzer.report": 6, "analyzer.pipeline": 7, "analyzer.job": 7, "analyzer.evaluate": 8, "analyzer.gate": 8, "analyzer.commands": 8,
    "analyzer.__main__": 9, "analyzer": 9,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    while module not in LAYERS:
        module = module.rsplit(".", 1)[0]
    return LAYERS[module]


def imports(path: Path) -> set[str]:
    """The analyzer modules `path` imports (`from analyzer.x import y` counts as analyzer.x, or analyzer.x.y
    where that is a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):  # imports for type checkers only are no dependency at run time
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "analyzer"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "analyzer":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if _is_module(sub) else node.module)
    return found


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / Path(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


NEVER = {("analyzer.ingest", "analyzer.diagnose"), ("analyzer.ingest", "analyzer.report"),
         ("analyzer.core", "analyzer.ingest"), ("analyzer.core", "analyzer.commands"),
         ("analyzer.attribute", "analyzer.ingest"), ("analyzer.attribute", "analyzer.diagnose"),
         ("analyzer.diagnose", "analyzer.ingest"), ("analyzer.diagnose", "analyzer.report"),
         ("analyzer.log_diagnose", "analyzer.ingest"), ("analyzer.log_diagnose", "analyzer.report"),
         ("analyzer.report", "analyzer.ingest"), ("analyzer.report", "analyzer.diagnose"),
         ("analyzer.job", "analyzer.report")}
#: the imports that still cross a "never" pair, and why each is not yet gone (issue 30 removed the last)
STILL_CROSSING: set[tuple[str, str]] = set()


def _package(module: str) -> str:
    """analyzer.report.view -> analyzer.report; analyzer.job -> analyzer.job."""
    return ".".join(module.split(".")[:2])


def _crossing() -> set[tuple[str, str]]:
    return {(m, i) for m, p in MODULES.items() for i in imports(p) if (_package(m), _package(i)) in NEVER}


def test_no_never_pair_imports() -> None:
    new = sorted(_crossing() - STILL_CROSSING)
    assert not new, "\n".join(f"{m} imports {i}: DESIGN.md says {_package(m)} never imports {_package(i)}"
                              for m, i in new)


def test_the_imports_still_crossing_are_still_there() -> None:
    """A crossing that is gone leaves the list, so the list states today's debt exactly."""
    assert not STILL_CROSSING - _crossing()


def test_every_module_has_a_layer() -> None:
    assert all(layer(m) >= 0 for m in MODULES)


def test_no_upward_import() -> None:
    upward = [f"{m} (layer {layer(m)}) imports {i} (layer {layer(i)})"
              for m, p in MODULES.items() for i in imports(p)
              if layer(i) > layer(m) and not m.startswith(i + ".")]
    assert not upward, "\n".join(upward)


def test_no_import_circle() -> None:
    graph = {m: {i for i in imports(p) if i in MODULES and i != m and not m.startswith(i + ".")}
             for m, p in MODULES.items()}
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for i in sorted(graph[m]):
            if state.get(i) == 1:
                circles.append(path[path.index(i):] + [i] if i in path else [m, i])
            elif i not in state:
                visit(i, path + [i])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_the_check_sees_a_never_pair(tmp_path: Path) -> None:
    """The checker itself: a reporter importing a reader is named as a never pair."""
    bad = tmp_path / "bad.py"
    bad.write_text("from analyzer.ingest import load\n", encoding="utf-8")
    assert ("analyzer.report", _package(next(iter(imports(bad))))) in NEVER


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: a core module importing the pipeline is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from analyzer.pipeline import analyze\n", encoding="utf-8")
    assert "analyzer.pipeline" in imports(bad)
    assert layer("analyzer.pipeline") > layer("analyzer.core.trace")
