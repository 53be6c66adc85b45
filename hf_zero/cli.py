"""The ``hf-zero`` command: ``plan`` (and, as they land, ``consolidate`` / ``inspect``)."""

from __future__ import annotations

import argparse
import sys


def _plan(args) -> int:
    from . import planner

    planner.run(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-zero", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from . import planner

    plan = sub.add_parser("plan", help="per-rank optimizer memory and balance of a fine-tune, before launching it",
                          description=planner.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    planner.add_arguments(plan)
    plan.set_defaults(handler=_plan)
    return parser


def main(argv=None) -> int:
    """Entry point of the ``hf-zero`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as e:
        print(f"hf-zero {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
