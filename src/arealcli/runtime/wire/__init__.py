"""The JSON shapes on the wire: SGLang's native protocol (`sglang`) and OpenAI's (`openai`), shared by the
server, the clients, the datasets and the agents.

Layer 0 of runtime/__init__.py's table: it imports only folders of lower layers.
"""
