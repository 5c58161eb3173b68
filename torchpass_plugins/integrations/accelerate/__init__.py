"""``TorchPass``: hot spares for a hand-written Hugging Face Accelerate loop."""
