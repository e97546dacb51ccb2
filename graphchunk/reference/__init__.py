"""What graphchunk is checked against, and its models without a model hub: the HF transformers
oracle and the SmolLM2 / tiny test checkpoints."""
