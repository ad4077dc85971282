"""The `pdcluster` command line and what each command does."""
