"""Baseline resource allocators (PETALS, BPRR, JFFC-only) behind the planner's interface."""
