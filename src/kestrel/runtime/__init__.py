"""Runtime support: reading checkpoints safely and resolving pinned Hugging Face repos."""
