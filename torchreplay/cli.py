"""The `torchreplay` command: `torchreplay demo`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchreplay", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the replay demo on embedded defaults (CPU, local disk)")
    demo.add_argument("--out", default="demo_output", help="directory for the demo's outputs")
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from torchreplay.demo_sampling import run

        return run(out=args.out, seed=args.seed)
    return 2


if __name__ == "__main__":
    sys.exit(main())
