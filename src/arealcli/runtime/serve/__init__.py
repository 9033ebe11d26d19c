"""`areal serve`: the HTTP server over the shared generation scheduler, and its start from the command
line (`start`: flags, refusals, the server, the keys line).

Layer 5: imports `generation`, `wire`.
"""
