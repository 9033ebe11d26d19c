"""Engines: training engines (hf, fsdp, megatron) and inference engines (in-process, sglang, vllm)."""
