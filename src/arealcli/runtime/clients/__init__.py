"""Clients of generation servers: SGLang's protocol (`client`), vLLM's OpenAI API (`vllm`), and the
launcher that starts and stops server processes (`launcher`).

Layer 4 of runtime/__init__.py's table: it imports only folders of lower layers.
"""
