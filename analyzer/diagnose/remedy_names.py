"""What people call the remedies: `--remedy bf16`, `fsdp`, `checkpointing` or `zero-3` name a remedy id.

A name resolves to an id when it is one (case, `-` and spaces aside), is a common name for one (ALIASES), or is
part of exactly one id (`accumulation`, `expandable`); anything else is an error that lists the ids.
"""
from __future__ import annotations

from analyzer.core.vocabulary import RemedyId
from analyzer.diagnose.remedies import BY_ID
from analyzer.errors import AnalyzerError

#: common names that are not part of the id they mean, or are part of several (`checkpointing` is what people
#: call full activation checkpointing; the selective kind is asked for by its name)
ALIASES: dict[str, str] = {
    "amp": RemedyId.BF16, "autocast": RemedyId.BF16, "fp16": RemedyId.BF16, "mixed_precision": RemedyId.BF16,
    "fsdp": RemedyId.ZERO3, "inference_mode": RemedyId.NO_GRAD, "adam8bit": RemedyId.OPTIMIZER_8BIT,
    "8bit_adam": RemedyId.OPTIMIZER_8BIT, "tp": RemedyId.TENSOR_PARALLEL, "pp": RemedyId.PIPELINE_PARALLEL,
    "checkpointing": RemedyId.ACTIVATION_CHECKPOINTING, "gradient_checkpointing": RemedyId.ACTIVATION_CHECKPOINTING,
    "selective": RemedyId.SELECTIVE_CHECKPOINTING}


def _key(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(" ", "_")


def resolve_remedy(name: str) -> str:
    """The remedy id `name` means; an AnalyzerError listing the ids when it means none, or several."""
    key = _key(name)
    squashed = {i.replace("_", ""): i for i in BY_ID}
    if key in BY_ID:
        return key
    if key in ALIASES:
        return str(ALIASES[key])
    if key.replace("_", "") in squashed:               # zero-3, micro-batch
        return squashed[key.replace("_", "")]
    within = [i for i in BY_ID if key and key in i]
    if len(within) == 1:
        return within[0]
    said = f"--remedy {name}: " + (f"could be {', '.join(within)}" if within else "no such remedy")
    raise AnalyzerError(None, said, f"Use one of: {', '.join(BY_ID)}.")


def remedy_help() -> str:
    """The ids, and the short names that also work, for --help."""
    return (f"remedy ids: {', '.join(BY_ID)}. Short names work too: a part of one id (checkpointing, "
            f"accumulation, expandable), zero-3, and {', '.join(sorted(ALIASES))}.")
