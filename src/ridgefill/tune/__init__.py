"""Per-model tuning: search fill configurations under accuracy budgets."""
