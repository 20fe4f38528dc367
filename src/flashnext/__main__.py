"""``python -m flashnext``: the same as the ``flashnext`` command."""

from flashnext.cli import main

main()
