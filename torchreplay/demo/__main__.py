"""`python -m torchreplay.demo [--out DIR] [--seed N] [--full | --quick]`."""

from __future__ import annotations

import argparse
import sys

from torchreplay.demo.runner import run


def main(argv: list[str] | None = None) -> int:
    """Parse demo flags and run it; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m torchreplay.demo", description=__doc__)
    parser.add_argument("--out", default="demo_output", help="directory for the demo's outputs")
    parser.add_argument("--seed", type=int, default=0)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--full", action="store_true", help="3 seeds and a uniform-replay arm")
    mode.add_argument("--quick", action="store_true", help="a few steps only (smoke test)")
    args = parser.parse_args(argv)
    return run(out=args.out, seed=args.seed, full=args.full, quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
