"""Every command's entry point (`main.py` names the subcommands). The only part of `petals_chain` that
may import upward (`orchestrator`, `server`), and only lazily, in the command that runs."""
