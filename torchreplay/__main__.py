"""`python -m torchreplay ...`: the same command as the `torchreplay` console script."""

import sys

from torchreplay.cli import main

if __name__ == "__main__":
    sys.exit(main())
