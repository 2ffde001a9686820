"""`python -m agentrt.cli ...`: the same as the `agentrt` command (tests and benchmarks start it so)."""
import sys

from agentrt.cli import main

sys.exit(main())
