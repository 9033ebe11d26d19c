"""One module per command (`areal train`, `check`, `list`, `serve`, `report`, `schema`, `init`): each
parses its arguments, delegates to `schema` and `runtime`, and prints. May import `schema` and `runtime`."""
