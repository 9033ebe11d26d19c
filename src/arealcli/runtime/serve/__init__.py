"""`areal serve`: the HTTP server over the shared generation scheduler.

Layer 5: imports `generation`, `wire`.
"""
