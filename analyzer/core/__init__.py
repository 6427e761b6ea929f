"""The core every stage stands on: the trace tables and their invariants, the timeline replay, stacks, the
allocator's rounding rules, units and the domain's vocabulary. Nothing here imports a later stage."""
