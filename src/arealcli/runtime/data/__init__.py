"""The data protocol (`sample.SequenceSample`: packed sequences with per-key lengths), tokenizers,
chat templates and the datasets that read prompt/answer and chat rows.

Layer 0: imports `wire` and `tools` at most (module level: nothing of `runtime`).
"""
