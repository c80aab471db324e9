"""`python -m loopcast.cli`: the command line."""

from loopcast.cli import main

main()
