"""`python -m slipstream.cli ...`: the `slipstream` command."""
import sys

from slipstream.cli.main import main

sys.exit(main())
