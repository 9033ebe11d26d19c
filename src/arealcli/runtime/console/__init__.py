"""What a person sees: the header, progress line and summary (`progress`), report.png and summaries of
finished runs (`report`).

Layer 0: imports nothing of `runtime` at module level.
"""
