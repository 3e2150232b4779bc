"""Accuracy measurements: tail perplexity now; RULER retrieval with issue 4."""
