"""`python -m torchreplay.demo [--out DIR] [--seed N] [--full | --quick] [--gen-cost R]`."""

from __future__ import annotations

import argparse
import sys

from torchreplay.demo.runner import run


def main(argv: list[str] | None = None) -> int:
    """Parse demo flags and run it; returns the exit code."""
    parser = argparse.ArgumentParser(prog="torchreplay demo", description=__doc__)
    parser.add_argument("--out", default="demo_output", help="directory for the demo's outputs")
    parser.add_argument("--seed", type=int, default=0)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--full", action="store_true",
                      help="both tasks, 3 seeds, on-policy and the replay study's winning arms")
    mode.add_argument("--quick", action="store_true", help="a few steps only (smoke test)")
    parser.add_argument("--s3", default=None, metavar="URI", help="checkpoint to s3://bucket/prefix instead of a local dir")
    parser.add_argument("--endpoint-url", default=None, help="S3 endpoint URL (with --s3)")
    parser.add_argument("--resume", action="store_true", help="continue a killed demo from its last checkpoint")
    parser.add_argument("--gen-cost", type=float, default=None, metavar="R",
                        help="a generated token's cost relative to a trained token (forward + backward) in the "
                             "compute columns; default 1/3, the FLOP ratio 2N/6N (Kaplan et al. 2020)")
    parser.add_argument("--task", choices=("sort", "arithmetic"), default="sort",
                        help="without --full: the digit-sort task (partial credit) or reasoning-gym arithmetic "
                             "(0/1 reward); --full runs both")
    args = parser.parse_args(argv)
    return run(task=args.task, out=args.out, seed=args.seed, full=args.full, quick=args.quick, resume=args.resume, s3=args.s3,
               endpoint_url=args.endpoint_url, gen_cost_per_token=args.gen_cost)


if __name__ == "__main__":
    sys.exit(main())
