"""Episodes: the tool_use workflow (`workflows`), OpenAI-client agents as workflows (`agent`), and the
built-in function-calling agent (`function_calling`).

Layer 4: imports `data`, `generation`, `tools`, `wire`.
"""
