"""Everything that needs torch: the engines and backends, the algorithms, the run.

Folders, in layers (a package imports, at module level, only packages of lower layers):
    0  wire, algo, models, data, rewards, console; loose: tools, optim, registry
    1  generation; loose: distributed
    2  engines
    3  clients
    4  backends, agents, interfaces
    5  run, serve, eval
    6  launchers
`tests/test_layout.py` holds the house to this.
"""
