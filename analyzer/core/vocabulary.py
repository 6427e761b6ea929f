"""The words of the domain, spelled once: phases of a training step, categories of memory, the roles a tensor
mark names, what they are called in sentences, their colours, and the annotation names analyzer's capture
helpers write and its attribution reads (one protocol, one writer and one reader of every name).

`Phase`, `Category` and `Role` are str-valued enums (as torch's `_memory_profiler.Category`, but with their
words as values): a member equals, hashes and formats as its word, so `phase == Phase.FORWARD`,
`{Phase.LOAD: ...}.get("load")` and `f"{Phase.FORWARD}"` all work on the plain strings of the tables. Values
put into tables or files should be plain strings (`Phase.FORWARD.value`): orjson and the safe unpickler do not
take enum members.

Names outside the vocabulary exist (a user's own `phase::warmup`, torch's `autograd_detail` category from
`export_memory_timeline`): every helper that takes a name takes any string.
"""
from __future__ import annotations

import re
from enum import Enum
from typing import TypeGuard


class Word(str, Enum):
    """An enum whose members are their words: str() and format() give the value on every Python >= 3.10."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, format_spec: str) -> str:
        return str.__format__(self, format_spec)


class Phase(Word):
    """The part of a training step an allocation was made in, in the order a run goes through them."""

    LOAD = "load"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    CHECKPOINT_SAVE = "checkpoint_save"
    COMPILE = "compile"
    OTHER = "other"

    @property
    def noun(self) -> str:
        """'optimizer step': the phase as a noun, for headlines ('optimizer step of layers.3')."""
        return _PHASE_NOUNS[self]

    @property
    def in_sentence(self) -> str:
        """'the optimizer step': the phase as it reads after 'in' in a sentence."""
        return _PHASE_IN_SENTENCE[self]

    @property
    def color(self) -> str:
        return _PHASE_COLORS[self]


class Category(Word):
    """What an allocation is for, in the order charts stack them: what lives longest at the bottom."""

    PARAMETER = "parameter"
    OPTIMIZER_STATE = "optimizer_state"
    GRADIENT = "gradient"
    INPUT = "input"
    ACTIVATION = "activation"
    TEMPORARY = "temporary"
    OTHER = "other"

    @property
    def plural(self) -> str:
        """'optimizer states': the category as the subject of a sentence."""
        return _CATEGORY_PLURALS[self]

    @property
    def color(self) -> str:
        return _CATEGORY_COLORS[self]


class GradMode(Word):
    """Whether autograd recorded the run's ops, as the recording says (a profiler trace's metadata, or the
    sequence numbers autograd gives the ops it records)."""

    ENABLED = "enabled"
    NO_GRAD = "no_grad"
    INFERENCE_MODE = "inference_mode"
    OFF = "off"                    # no op carries a sequence number: no_grad or inference_mode, the trace cannot say which

    @property
    def autograd_off(self) -> bool:
        return self is not GradMode.ENABLED


class Role(Word):
    """What a `tensor::` mark says a storage is. A buffer is model state like a parameter: the attribution
    files both under `Category.PARAMETER` (only the simulator's ground truth keeps them apart)."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"

    @property
    def category(self) -> Category:
        return Category.PARAMETER if self is Role.BUFFER else Category(self.value)


class FindingKind(Word):
    """What a finding is about: its `kind` in the results and the JSON, one detector each."""

    OUTSIDE_PYTORCH = "outside_pytorch"
    OOM = "oom"
    LEAK = "leak"
    RESERVED_GROWTH = "reserved_growth"
    ACTIVATION_PEAK = "activation_peak"
    OPTIMIZER_SPIKE = "optimizer_spike"
    CHECKPOINT_GATHER = "checkpoint_gather"
    FRAGMENTATION = "fragmentation"
    IMBALANCE = "imbalance"
    CONV_WORKSPACE = "conv_workspace"
    KV_CACHE = "kv_cache"


class RemedyId(Word):
    """A remedy's id, as the results and the JSON name it: each has one spec in analyzer.diagnose.remedies.REMEDIES
    (the simulator, below the diagnosis, and the run log, which reads JSON, name remedies by these words too)."""

    FIX_LEAK = "fix_leak"
    STATE_DICT_OFFLOAD = "state_dict_offload"
    SHARDED_SAVE = "sharded_save"
    INIT_OPTIMIZER_STATE = "init_optimizer_state"
    NO_GRAD = "no_grad"
    FUSED_ATTENTION = "fused_attention"
    KV_CACHE_OFF = "kv_cache_off"
    KV_CACHE_QUANTIZED = "kv_cache_quantized"
    BALANCE_SCATTER = "balance_scatter"
    MICRO_BATCH = "micro_batch"
    BF16 = "bf16"
    WEIGHT_QUANTIZATION = "weight_quantization"
    WEIGHT_QUANTIZATION_4BIT = "weight_quantization_4bit"
    GRADIENT_ACCUMULATION = "gradient_accumulation"
    SELECTIVE_CHECKPOINTING = "selective_checkpointing"
    ACTIVATION_CHECKPOINTING = "activation_checkpointing"
    OPTIMIZER_8BIT = "optimizer_8bit"
    ADAFACTOR = "adafactor"
    OPTIMIZER_OFFLOAD = "optimizer_offload"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"
    TENSOR_PARALLEL = "tensor_parallel"
    PIPELINE_PARALLEL = "pipeline_parallel"
    MODEL_CHANGES = "model_changes"
    EXPANDABLE_SEGMENTS = "expandable_segments"
    MAX_SPLIT_SIZE = "max_split_size"
    OFFLOAD = "offload"
    CUDNN_BENCHMARK_OFF = "cudnn_benchmark_off"

    @property
    def layout_only(self) -> bool:
        """It frees reserved memory no tensor uses (an allocator setting): the allocated peak stays, so its saving
        is measured on the reserved peak."""
        return self in LAYOUT_ONLY_REMEDIES

    @property
    def variables(self) -> tuple[str, ...]:
        """The run log's config variables it changes (two runs that differ there check its prediction)."""
        return REMEDY_VARIABLES.get(self, ())


#: what the run log, which reads JSON and pairs runs, must know of a remedy beyond its id; the registry
#: (analyzer.diagnose.remedies) reads them here, so they are stated once
LAYOUT_ONLY_REMEDIES = frozenset({RemedyId.EXPANDABLE_SEGMENTS, RemedyId.MAX_SPLIT_SIZE})
REMEDY_VARIABLES: dict[RemedyId, tuple[str, ...]] = {
    RemedyId.BF16: ("precision", "autocast"), RemedyId.ZERO1: ("gpus",), RemedyId.ZERO2: ("gpus",),
    RemedyId.ZERO3: ("gpus",), RemedyId.TENSOR_PARALLEL: ("gpus",)}


#: the label source of rows whose category torch's memory profiler gave (an export_memory_timeline file's rows)
TORCH_PROFILER_LABEL_SOURCE = "torch_memory_profiler"
#: torch's memory-profiler categories spelled as ours, where the words differ
AS_OUR_CATEGORY = {"autograd_detail": Category.TEMPORARY.value}
#: how to record what an Nsight export lacks when it has no device memory (its reader and the diagnosis say it)
RECORD_MEMORY_HINT = ("Record device memory next time: nsys profile --cuda-memory-usage=true --trace=cuda,nvtx "
                      "--output run python train.py, then nsys export --type sqlite --output run.sqlite run.nsys-rep")

#: the JSON contract every report writes (a recording's Analysis and a log's alike): later versions add fields and
#: never rename or drop them
SCHEMA = "analyzer/1"
RUN_LOG_ENV = "ANALYZER_RUN_LOG"   # the log of runs `analyze FILE` appends to when --log is not given
#: the label of what could not be attributed (category, phase or module)
UNATTRIBUTED = "unattributed"
#: the root module's name in results (its FQN is the empty string)
ROOT_MODULE = "(root module)"
#: the module of what the frames show was made while no module ran: the script's own code (a loss, a batch, an
#: optimizer's temporaries), not a module's forward, backward or construction
NO_MODULE = "(no module)"
#: between the levels of a module call path, outermost first (`GPT › Block[3] › MLP`): U+203A with spaces, a
#: character no FQN, class name or file path holds
MODULE_PATH_SEPARATOR = " \u203a "


def names_module(label: str | None) -> TypeGuard[str]:
    """Whether a module label names a module: not unattributed, nor made outside every module."""
    return bool(label) and label not in (UNATTRIBUTED, NO_MODULE)


PHASES: tuple[str, ...] = tuple(p.value for p in Phase)
CATEGORIES: tuple[str, ...] = tuple(c.value for c in Category)
#: created once and kept for the whole run: a leak is anything else that is kept
MODEL_STATES: tuple[str, ...] = (Category.PARAMETER.value, Category.GRADIENT.value, Category.OPTIMIZER_STATE.value)
#: categories in the order they are stacked in charts, the unattributed rest on top
CATEGORY_ORDER: tuple[str, ...] = (*CATEGORIES, UNATTRIBUTED)

# ---- words --------------------------------------------------------------------------------------------------
_PHASE_NOUNS: dict[str, str] = {Phase.FORWARD: "forward", Phase.BACKWARD: "backward", Phase.OPTIMIZER: "optimizer step",
                Phase.LOAD: "model loading", Phase.CHECKPOINT_SAVE: "checkpoint save", Phase.COMPILE: "torch.compile",
                Phase.OTHER: "between steps"}
_PHASE_IN_SENTENCE: dict[str, str] = {Phase.FORWARD: "the forward pass", Phase.BACKWARD: "the backward pass",
                      Phase.OPTIMIZER: "the optimizer step", Phase.LOAD: "model loading",
                      Phase.CHECKPOINT_SAVE: "the checkpoint save", Phase.COMPILE: "torch.compile",
                      Phase.OTHER: "between steps"}
_CATEGORY_PLURALS: dict[str, str] = {Category.ACTIVATION: "activations", Category.TEMPORARY: "temporaries",
                     Category.PARAMETER: "parameters", Category.GRADIENT: "gradients",
                     Category.OPTIMIZER_STATE: "optimizer states", Category.INPUT: "inputs",
                     Category.OTHER: "other allocations"}


def phase_noun(name: str | None) -> str | None:
    """Phase.noun for a known phase, None for any other name."""
    return _PHASE_NOUNS.get(name) if name is not None else None


def phase_in_sentence(name: str) -> str:
    """Phase.in_sentence for a known phase, the name itself for any other ('in warmup')."""
    return _PHASE_IN_SENTENCE.get(name, name)


def category_plural(name: str) -> str:
    """Category.plural for a known category, the name itself for any other."""
    return _CATEGORY_PLURALS.get(name, name)


# ---- colours: one per category and per phase, shared by every chart and bar, so a colour means the same thing
# in the timeline, the breakdown bars and the PNG pasted into an issue ---------------------------------------
_UNATTRIBUTED_COLOR = "#c7c7c7"
_CATEGORY_COLORS: dict[str, str] = {
    Category.PARAMETER: "#4c72b0", Category.OPTIMIZER_STATE: "#8172b3", Category.GRADIENT: "#55a868",
    Category.INPUT: "#937860", Category.ACTIVATION: "#dd8452", Category.TEMPORARY: "#c44e52",
    Category.OTHER: "#8c8c8c", UNATTRIBUTED: _UNATTRIBUTED_COLOR,
}
_PHASE_COLORS: dict[str, str] = {
    Phase.LOAD: "#4c72b0", Phase.FORWARD: "#dd8452", Phase.BACKWARD: "#55a868", Phase.OPTIMIZER: "#8172b3",
    Phase.CHECKPOINT_SAVE: "#da8bc3", Phase.COMPILE: "#937860", Phase.OTHER: "#8c8c8c",
    UNATTRIBUTED: _UNATTRIBUTED_COLOR,
}
# for names we do not know (a user's own phase tag): stable across runs, distinct from the named ones
_SPARE_COLORS = ("#64b5cd", "#ccb974", "#17becf", "#bcbd22", "#9467bd", "#e377c2")


def _pick(table: dict[str, str], name: str) -> str:
    if name in table:
        return table[name]
    return _SPARE_COLORS[sum(name.encode()) % len(_SPARE_COLORS)]


def category_color(name: str) -> str:
    return _pick(_CATEGORY_COLORS, name)


def phase_color(name: str) -> str:
    return _pick(_PHASE_COLORS, name)


def category_rank(name: str) -> tuple[int, str]:
    """Sort key: known categories in stacking order, unknown ones after them by name."""
    return (CATEGORY_ORDER.index(name) if name in CATEGORY_ORDER else len(CATEGORY_ORDER), name)


# ---- the annotation protocol ----------------------------------------------------------------------------------
# Names written by analyzer's capture helpers (analyzer.recording) and the simulator's tracer, read by
# analyzer.attribute:
#
#     phase::<name>                    a phase of the step (analyzer.phase)
#     module::forward::<fqn>           a module's forward; the root module's fqn is "" (`module::forward::`)
#     module::backward::<fqn>          its backward
#     tensor::<role>::<fqn>::<0xaddr>  the storage at that address is a <role> (Role) of the module <fqn>
SEPARATOR = "::"
PHASE_PREFIX = "phase::"
MODULE_PREFIX = "module::"
TENSOR_PREFIX = "tensor::"
MODULE_DIRECTIONS = (Phase.FORWARD.value, Phase.BACKWARD.value)

_PHASE_LABEL = re.compile(r"^phase::(\w+)$")
_MODULE_LABEL = re.compile(rf"^module::({'|'.join(MODULE_DIRECTIONS)})::(.*)$")
_TENSOR_MARK = re.compile(rf"^tensor::({'|'.join(r.value for r in Role)})::(.*)::(0x[0-9a-fA-F]+)$")


def phase_label(name: str) -> str:
    """'phase::forward'."""
    return f"{PHASE_PREFIX}{name}"


def parse_phase_label(label: str) -> str | None:
    """The phase a `phase::<name>` label names (a word of letters, digits and underscores), else None."""
    m = _PHASE_LABEL.match(label)
    return m.group(1) if m else None


def module_label(direction: str, fqn: str) -> str:
    """'module::forward::layers.0.mlp'; `direction` is forward or backward."""
    if direction not in MODULE_DIRECTIONS:
        raise ValueError(f"a module range is {' or '.join(MODULE_DIRECTIONS)}, not {direction!r}")
    return f"{MODULE_PREFIX}{direction}{SEPARATOR}{fqn}"


def parse_module_label(label: str) -> tuple[str, str] | None:
    """(direction, fqn) of a `module::<direction>::<fqn>` label (fqn "" for the root module), else None."""
    m = _MODULE_LABEL.match(label)
    return (m.group(1), m.group(2)) if m else None


def tensor_mark(role: str, fqn: str, address: int | str) -> str:
    """'tensor::parameter::layers.0.weight::0x7f00...'. An address that is not known yet (the simulator's
    `uid:<n>`, replaced by the block's address when replayed) may be given as text."""
    where = f"{address:#x}" if isinstance(address, int) else address
    return f"{TENSOR_PREFIX}{role}{SEPARATOR}{fqn}{SEPARATOR}{where}"


def parse_tensor_mark(label: str) -> tuple[str, str, int] | None:
    """(role, fqn, address) of a `tensor::<role>::<fqn>::<0xaddr>` mark, else None."""
    if not label.startswith(TENSOR_PREFIX):
        return None
    m = _TENSOR_MARK.match(label)
    return (m.group(1), m.group(2), int(m.group(3), 16)) if m else None


# ---- torch's own names, read by the attribution and written by the simulator as torch writes them ------------
PROFILER_STEP_PREFIX = "ProfilerStep#"       # torch.profiler's step ranges: ProfilerStep#<n>
OPTIMIZER_STEP_PREFIX = "Optimizer.step#"    # Optimizer.step#<Class>.step
OPTIMIZER_ZERO_GRAD_PREFIX = "Optimizer.zero_grad#"
RECORD_HISTORY = "torch.cuda.memory._record_memory_history(max_entries=100000)"   # the line that records a history
