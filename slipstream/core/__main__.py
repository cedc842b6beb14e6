"""`python -m slipstream.core CONFIG_JSON IN_ADDR OUT_ADDR PARENT_PID`: an engine core process."""
import sys

from slipstream.core.service import main

sys.exit(main(sys.argv[1:]))
