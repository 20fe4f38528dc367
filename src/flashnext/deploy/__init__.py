"""What runs and what may run: the pre-boot compatibility check (and, to come, deployment
records with diff and rollback). Reads configs, headers and arguments; never starts a model."""
