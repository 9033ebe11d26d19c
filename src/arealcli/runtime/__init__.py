"""Everything that needs torch: the engines and backends, the algorithms, the run.

Folders, in layers (a package imports, anywhere in its code, only packages of lower layers):
    0  wire (the protocols' messages), tools; loose: vision (images in, for vision-language models)
    1  algo, models, data, rewards, console; loose: optim, registry
    2  generation; loose: distributed
    3  engines
    4  clients, eval
    5  backends, agents, interfaces
    6  run, serve
    7  launchers, evaluate (`areal eval`'s orchestration)
`tests/test_layout.py` holds the house to this.
"""
