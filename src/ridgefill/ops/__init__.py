"""Pure tensor functions: no transformers import, no model state."""
