"""Using a trained model: KV-cached generation (generate.py)."""
