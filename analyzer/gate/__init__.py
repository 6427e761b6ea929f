"""The memory gate behind `analyze check`: a run's peak summarised (summary.py), read from whatever the user keeps
(inputs.py: a recording, an analyzer/1 JSON result, a baseline file, Megatron-LM golden values), judged against
a budget or a baseline (compare.py), and told as plain text, JSON, GitHub annotations and a Markdown summary
(render.py, github.py). Nothing here parses command lines: the command and the pytest plugin both use it.
"""
