"""Sampling tokens: the shared batched generate loop with stop texts (`sampling`), the lean KV-cache
decoder (`decoder`), a model in memory for serving (`model_runner`) and the batching scheduler that
runs concurrent requests together (`scheduler`; `running_batch`: the rows of a continuous batch) — what
`areal serve` and the `local` backend share.

Layer 2 of runtime/__init__.py's table: it imports only folders of lower layers.
"""
