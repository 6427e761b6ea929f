"""Recording a run that can explain its OOM (torch is imported only when used): `capture`, `phase`, `tag_modules`."""
from analyzer.recording.modules import tag_modules
from analyzer.recording.phases import phase
from analyzer.recording.session import Capture

capture = Capture

__all__ = ["Capture", "capture", "phase", "tag_modules"]
