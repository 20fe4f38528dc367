"""Development tools shared by tests/ and bench/ (not part of the flashnext package).

bench/ must not import from tests/, and these tools start models and pip-install runtimes,
which the product never does (validate talks only HTTP), so they live here, beside both.
"""
