"""Orchestrator core (papers/chain-serving-gbp-cr-gca-jffc.txt): pure functions over dataclasses.

model (system model, eqs 1-3) · placement_gbp_cr (Alg. 1) · cache_gca (Alg. 2) · tuning (c*) ·
bounds (Theorem 3.7, App. A.3) · dispatch (JFFC = Alg. 3, JSQ, JIQ, SED, SA-JSQ) ·
baselines (PETALS, BPRR, JFFC-only) · reference_optima (ILP, brute force) · planner (``plan``) ·
cluster_io + plan_cli (``petals-chain plan``). See docs/orchestrator.md.
"""
