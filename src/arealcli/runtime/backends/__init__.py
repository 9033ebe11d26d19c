"""Model backends: factories that turn a model into an engine — hf, fsdp, megatron/ (training); local,
sglang, vllm (generation); packing (the rows a micro-batch's forward runs as: no compute on padding).

Layer 5 of runtime/__init__.py's table: it imports only folders of lower layers.
"""
