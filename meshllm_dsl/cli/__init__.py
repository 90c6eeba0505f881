"""`meshc`, the command line: one module per group of subcommands; `main` is in cli/main.py."""
