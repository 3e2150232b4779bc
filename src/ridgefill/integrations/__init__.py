"""Adapters to other people's tools (lm-evaluation-harness). Each is an optional extra."""
