"""Engine adapters: ``hf`` (transformers)."""
