"""Engine adapters: ``hf`` (transformers) and ``vllm`` (a vLLM plugin)."""
