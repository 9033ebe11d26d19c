"""The data protocol (`sample.SequenceSample`: packed sequences with per-key lengths), tokenizers,
chat templates and the datasets that read prompt/answer, chat and preference rows (preferences.py:
how a pair of chosen and rejected responses travels in a batch).

Layer 1 of runtime/__init__.py's table: it imports only folders of lower layers.
"""
