"""The `minillm` command; each subcommand is imported only when it runs."""
