"""Experiment drivers on live swarms (the paper's real-system Table 1): they start processes in
emulated hosts (netem) or on localhost, replay traces and write results under `results/`.
May import every other package of the project (DESIGN.md)."""
