"""The data protocol (`sample.SequenceSample`: packed sequences with per-key lengths), tokenizers,
chat templates and the datasets that read prompt/answer and chat rows.

Layer 1 of runtime/__init__.py's table: it imports only folders of lower layers.
"""
