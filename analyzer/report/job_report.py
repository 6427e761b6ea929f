"""What the reporters render for a job of many ranks: no Analysis (the traces stayed on the workers), but its
merged view, its JSON document and the small pictures the HTML draws per device.

Every reporter takes a `Report`: one recording's Analysis, or a JobReport; `report_view` gives the view of
either, so the verdict, the overview, the devices worst first and the comparison render the same way.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:  # pandas and numpy stand behind these: a log's report (json_report) names Report only
    from analyzer.report.interactive import AllocatorPicture, IcicleNode
    from analyzer.report.view import ReportView
    from analyzer.result import Analysis


@dataclass(frozen=True)
class DevicePictures:
    """The HTML's allocator pictures and module icicle of one device, made where its trace was."""

    allocator: list[AllocatorPicture] | None
    icicle: list[IcicleNode] = field(default_factory=list)


@dataclass(frozen=True)
class JobReport:
    view: ReportView                       # devices numbered apart across ranks (analyzer.commands.job_view)
    document: dict[str, Any]               # the job's analyzer/1 JSON
    pictures: dict[int, DevicePictures]    # by the view's device numbers

    def to_json_text(self) -> str:
        return json.dumps(self.document, indent=2)


Report = Union["Analysis", JobReport]


def report_view(report: Report) -> ReportView:
    from analyzer.report.view import build_view

    return report.view if isinstance(report, JobReport) else build_view(report)
