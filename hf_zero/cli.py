"""The ``hf-zero`` command: ``plan``, ``consolidate`` and ``inspect``."""

from __future__ import annotations

import argparse
import sys


def _plan(args) -> int:
    from . import _planner as planner

    planner.run(args)
    return 0


def _consolidate(args) -> int:
    from . import _offline

    if args.weights:
        if args.output:
            raise ValueError("--weights: give either an output state dict file or --weights, not both")
        weights = _offline.fp32_weights(args.checkpoint)
        _offline.save_weights(weights, args.weights)
        print(f"wrote {args.weights}: {len(weights)} float32 weights")
        return 0
    if not args.output:
        raise ValueError("output: name the state dict file to write (or --weights FILE.safetensors)")
    count = _offline.write_plain_optimizer(_offline.sharded_dir(args.checkpoint), args.output)  # 16 MiB at a time
    print(f"wrote {args.output}: state of {count} params")
    return 0


def _inspect(args) -> int:
    from . import _offline

    print(_offline.inspect_checkpoint(args.checkpoint))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-zero", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from . import _planner as planner

    plan = sub.add_parser("plan", help="per-rank optimizer memory and balance of a fine-tune, before launching it",
                          description=planner.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    planner.add_arguments(plan)
    plan.set_defaults(handler=_plan)

    merge = sub.add_parser(
        "consolidate",
        help="merge a sharded optimizer checkpoint into one plain PyTorch optimizer state dict (CPU, no process group)",
        description="Merge the directory written by optimizer.save_sharded() into a torch.save'd optimizer state "
        "dict, optimizer state included, loadable with torch.load(weights_only=True) into the plain optimizer "
        "class or into ZeroBucketOptimizer.load_state_dict() on any world size.",
    )
    merge.add_argument("checkpoint", help="directory written by optimizer.save_sharded() (with --weights also a "
                       "Trainer checkpoint directory or an optimizer state dict file)")
    merge.add_argument("output", nargs="?", help="file to write (written atomically)")
    merge.add_argument("--weights", metavar="FILE.safetensors",
                       help="instead write float32 model weights: the optimizer's master weights, the other "
                       "weights of model.safetensors upcast (as DeepSpeed's zero_to_fp32.py)")
    merge.set_defaults(handler=_consolidate)

    show = sub.add_parser("inspect", help="print what a sharded optimizer checkpoint holds")
    show.add_argument("checkpoint", help="directory written by optimizer.save_sharded()")
    show.set_defaults(handler=_inspect)
    return parser


def main(argv=None) -> int:
    """Entry point of the ``hf-zero`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, OSError) as e:
        print(f"hf-zero {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
