"""Generation servers speaking SGLang's native HTTP protocol.

- `protocol`: the JSON shapes of `/generate` and `/update_weights_from_disk` (shared by server and client).
- `scheduler` + `model_runner` + `http_server`: `areal serve`, an embedded server over our own generation.
- `launcher`: start `python -m sglang.launch_server` or `areal serve` processes and wait until ready.
- `client`: an async client with load balancing, retries and re-sending of aborted requests.
"""
