"""TTFT benchmarks: methods side by side in one process, with a FLOP-model bound."""
