"""Episodes: the tool_use workflow (`workflows`), OpenAI-client agents as workflows (`agent`), and the
built-in function-calling agent (`function_calling`).

Layer 5 of runtime/__init__.py's table: it imports only folders of lower layers.
"""
