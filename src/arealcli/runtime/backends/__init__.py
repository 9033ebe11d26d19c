"""Model backends: factories that turn a model into an engine — hf, fsdp, megatron/ (training); local,
sglang, vllm (generation); packing (the rows a micro-batch's forward runs as: no compute on padding).

Layer 4: imports `clients`, `data`, `engines`, `generation`, `models`, `wire`, `distributed`, `optim`.
"""
