"""Accuracy measurements: tail perplexity, RULER retrieval, and the experimental ablation tools."""
