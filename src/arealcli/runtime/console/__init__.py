"""What a person sees: the header, progress line and summary (`progress`), report.png and summaries of
finished runs (`report`).

Layer 1 of runtime/__init__.py's table: it imports only folders of lower layers.
"""
