"""Clients of generation servers: SGLang's protocol (`client`), vLLM's OpenAI API (`vllm`), and the
launcher that starts and stops server processes (`launcher`).

Layer 3: imports `engines`, `wire`.
"""
