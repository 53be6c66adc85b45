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
        return _export_weights(args)
    if args.model or args.max_shard_size:
        raise ValueError("--model and --max-shard-size go with --weights")
    if not args.output:
        raise ValueError("output: name the state dict file to write (or --weights FILE.safetensors)")
    from . import _export

    count = _offline.write_plain_optimizer(_export.sharded_source(args.checkpoint), args.output)  # 16 MiB at a time
    print(f"wrote {args.output}: state of {count} params")
    return 0


def _export_weights(args) -> int:
    import os

    from . import _export

    if args.output:
        raise ValueError(f"--weights: give either an output state dict file or --weights, not both (got "
                         f"{args.output!r} too; the order is: hf-zero consolidate CHECKPOINT --weights OUT)")
    as_file = args.weights.endswith(".safetensors")
    if as_file and args.max_shard_size:
        raise ValueError("--max-shard-size: only for a directory output (--weights DIR)")
    max_shard = _export.parse_size(args.max_shard_size or "5GB")  # checked before the (long) read
    export = _export.fp32_export(args.checkpoint, model=args.model)
    if as_file:
        _export.write_file(export, args.weights)
        out = args.weights
    else:
        files = _export.write_directory(export, args.weights, max_shard)
        out = os.path.join(args.weights, files[0] if len(files) == 1 else files[0].split("-")[0] + ".safetensors.index.json")
    first, *rest = export.summary(out)
    print(first)
    for line in rest:
        print(line, file=sys.stderr)
    return 0


def _inspect(args) -> int:
    from . import _offline

    from . import _export

    print(_offline.inspect_checkpoint(_export.sharded_source(args.checkpoint)))
    return 0


_PLAN_DESCRIPTION = """\
Per-rank memory, balance and collectives of a fine-tune, before launching it.

The model is built on the meta device from its Hugging Face config (no weights, no
download) and planned by the layout planner the optimizer uses at run time, for
hf_zero's flat and param sharding, next to torch's ZeroRedundancyOptimizer
partition of the same params (whole params, largest first, frozen params counted
at full size) and the published accountings. --device-memory adds which of hf_zero
stage 1, stage 2 and FSDP2 fits a device.

The JSON report (--json) names its layout in its "schema" field; the report and
every flag are described in the docs (docs/planner.md, docs/reference/cli.md)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-zero", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from . import _planner as planner

    plan = sub.add_parser("plan", help="per-rank optimizer memory and balance of a fine-tune, before launching it",
                          description=_PLAN_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    planner.add_arguments(plan)
    plan.set_defaults(handler=_plan)

    merge = sub.add_parser(
        "consolidate",
        help="merge a sharded optimizer checkpoint into one plain PyTorch optimizer state dict (CPU, no process group)",
        description="Merge the directory written by optimizer.save_sharded() into a torch.save'd optimizer state\n"
        "dict, optimizer state included, loadable with torch.load(weights_only=True) into the plain optimizer\n"
        "class or into ZeroBucketOptimizer.load_state_dict() on any world size; or, with --weights, write\n"
        "the model's float32 weights from the fp32 master weights.",
        epilog="examples:\n"
        "  hf-zero consolidate ckpt/optimizer optimizer.pt\n"
        "  hf-zero consolidate out/checkpoint-500 optimizer.pt\n"
        "  hf-zero consolidate out/checkpoint-500 --weights fp32-model          # from_pretrained('fp32-model')\n"
        "  hf-zero consolidate out/checkpoint-500 --weights fp32.safetensors\n"
        "  hf-zero consolidate ckpt/optimizer --weights fp32.safetensors --model ckpt/model.safetensors",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    merge.add_argument("checkpoint", help="directory written by optimizer.save_sharded(), or a Trainer / Accelerate "
                       "checkpoint directory or its optimizer.pt / optimizer.bin (a sharded reference is followed to "
                       "its sharded files, also in a moved or copied checkpoint)")
    merge.add_argument("output", nargs="?", help="file to write (written atomically)")
    merge.add_argument("--weights", metavar="OUT",
                       help="instead write float32 model weights (as DeepSpeed's zero_to_fp32.py): each weight of the "
                       "checkpoint's model files (model.safetensors or model.safetensors.index.json, or a PEFT adapter's "
                       "adapter_model.safetensors) from its fp32 "
                       "master where the optimizer state holds one that rounds to the saved weight, else the saved "
                       "weight upcast. OUT ending in .safetensors: one file (load_state_dict); else a directory "
                       "from_pretrained loads (weights, config.json with dtype float32, tokenizer files)")
    merge.add_argument("--model", metavar="DIR_OR_FILE",
                       help="with --weights: the model weights (directory, .safetensors/.bin file or .index.json) "
                       "when they are not in or next to CHECKPOINT, e.g. for a plain save_sharded() directory")
    merge.add_argument("--max-shard-size", metavar="SIZE",
                       help="with --weights DIR: split the weights into files of at most SIZE (default 5GB)")
    merge.set_defaults(handler=_consolidate)

    show = sub.add_parser("inspect", help="print what a sharded optimizer checkpoint holds")
    show.add_argument("checkpoint", help="directory written by optimizer.save_sharded(), or a Trainer / Accelerate "
                      "checkpoint (directory or optimizer file) whose optimizer state is a sharded reference")
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
