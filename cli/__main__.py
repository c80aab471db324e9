"""``python -m loopcast.cli``: the same command line as the ``loopcast`` script."""

from loopcast.cli import main

main()
