"""Running a recipe: the run directory and its policy (`session`), the one driver that builds, trains and
closes a run (`driver`), its supervision (`supervise`: attempts, recovery from the last checkpoint, the
command that continues a stopped run), the trainer and its step loop (`trainer`, `dataflow`,
`rollout`), weights moving to followers (`weight_sync`), checkpoints, metrics, the multi-process
launcher and the thread policy.

Layer 6 of runtime/__init__.py's table: it imports only folders of lower layers.
"""
