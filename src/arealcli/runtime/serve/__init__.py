"""`areal serve`: the HTTP server over the shared generation scheduler, and its start from the command
line (`start`: flags, refusals, the server, the keys line).

Layer 6 of runtime/__init__.py's table: it imports only folders of lower layers.
"""
