"""A text log's judgement: the cause of each OOM (cause), what to change for it (advice), and what the repeated
memory lines show across the log (trends).

Apart from analyzer.diagnose, whose package imports the recording's detectors and with them pandas and numpy:
`analyze train.log` imports neither (a log holds a few lines of numbers, not tables).
"""
