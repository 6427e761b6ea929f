"""`--format md` for a log: the verdict, per OOM a table of its numbers, its cause and remedies, the findings
across lines and what to record next. Every string from the log goes through `md_text` or `md_code`."""
from __future__ import annotations

from pathlib import Path

from analyzer.core.log_records import gpu_name
from analyzer.core.units import human_bytes
from analyzer.log_result import LogAnalysis
from analyzer.report.log_text import TOP_REMEDIES, numbers_table
from analyzer.report.md_escape import code_block, md_code, md_text


def render_log_markdown(report: LogAnalysis) -> str:
    doc = report.to_json()
    out = ["## GPU out of memory: what the log says", "", f"**{md_text(report.verdict)}**", ""]
    for i, o in enumerate(doc["ooms"], 1):
        where = ", ".join(x for x in (f"rank {o['rank']}" if o["rank"] is not None else "",
                                      f"{o['backend']} device {o['device']}" if o["device"] is not None else "") if x)
        out += [f"### OOM {i} (line {o['line']}{', ' + md_text(where) if where else ''})", "",
                f"- cause: **{md_text(o['cause'])}**: {md_text(o['reason'])}",
                (f"- phase: {md_text(o['phase'] or 'unknown')}; your frame: "
                 f"{md_code(o['user_frame']) if o['user_frame'] else 'none printed'}"), ""]
        out += ["| | bytes | |", "|---|---:|---:|"]
        out += [f"| {label} | {value} | {human_bytes(value)} |" for label, value in numbers_table(o)]
        out += [f"| process {md_code(p['pid'], True)} | {p['bytes']} | {human_bytes(p['bytes'])} |" for p in o["other_processes"]]
        out.append("")
        out += [f"- note: {md_text(n)}" for n in [*o["inconsistent"], *o["notes"]]]
        for j, r in enumerate(o["remedies"][:TOP_REMEDIES], 1):
            saves = f" ({human_bytes(r['bytes'])})" if r["bytes"] else ""
            out.append(f"{j}. **{md_text(r['title'])}**{saves}: {md_text(r['detail'])}")
            if r["code"]:
                out += code_block(r["code"], "   ")
        out.append("")
    if doc["findings"] or doc["gpu_peaks"] or doc["gpu_processes"] or doc["memory_highs"]:
        out += ["### Across the log", ""]
        out += [f"- {md_text(f['kind'])}: {md_text(f['summary'])}" + (f"; try: {md_code(f['remedy'])}" if f.get("remedy") else "")
                for f in doc["findings"]]
        out += [f"- {gpu_name(p['device'])}: at most {human_bytes(p['used_bytes'])} used (nvidia-smi)" for p in doc["gpu_peaks"]]
        out += [f"- {gpu_name(p['device'])}: {md_code(p['process'])} uses {human_bytes(p['used_bytes'])}" for p in doc["gpu_processes"]]
        out += [f"- {md_text(h['summary'])}" for h in doc["memory_highs"]]
        out.append("")
    out += [f"- warning: {md_text(w)}" for w in doc["warnings"]]
    out += ["### What to record next", "", "A log holds moments; a snapshot holds the history of every allocation:", ""]
    out += code_block(doc["record_next"]["snapshot"], "")
    return "\n".join(out) + "\n"


def write_log_markdown(report: LogAnalysis, out: Path) -> list[Path]:
    out.write_text(render_log_markdown(report), encoding="utf-8")
    return [out]
