"""Command line: ``nsa train``, ``nsa sample`` and ``nsa export``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from nsa.train import TRAIN_PRESETS, build_config, sample_checkpoint, train
from nsa.train.checkpoint import RunDirError, export_model, latest_checkpoint
from nsa.train.config import DEVICES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nsa", description="Native Sparse Attention")
    commands = parser.add_subparsers(dest="command", required=True)

    train_cmd = commands.add_parser(
        "train", help="train a language model on the bundled corpus",
        description="Train a preset; override any ModelConfig or TrainConfig field with "
                    "key=value (optionally prefixed model. or train.), e.g. "
                    "'nsa train --preset tiny max_steps=100 dim=64'.",
    )
    train_cmd.add_argument("--preset", default="tiny", choices=sorted(TRAIN_PRESETS))
    train_cmd.add_argument("--resume", action="store_true",
                           help="continue from the newest checkpoint in run_dir/checkpoints")
    train_cmd.add_argument("--overwrite", action="store_true",
                           help="start over in a run_dir that already holds a checkpoint")
    train_cmd.add_argument("overrides", nargs="*", metavar="key=value")
    train_cmd.set_defaults(run=run_train)

    sample_cmd = commands.add_parser("sample", help="print a sample from a trained checkpoint")
    sample_cmd.add_argument("--run-dir", type=Path, required=True,
                            help="a run directory, or a model file written by 'nsa export'")
    sample_cmd.add_argument("--prompt", default=None, help="default: the run's sample_prompt")
    sample_cmd.add_argument("--tokens", type=int, default=None, help="bytes to generate")
    sample_cmd.add_argument("--temperature", type=float, default=None)
    sample_cmd.add_argument("--device", default="auto", choices=DEVICES)
    sample_cmd.set_defaults(run=run_sample)

    export_cmd = commands.add_parser(
        "export", help="write a run's newest checkpoint as one model file (no optimizer)")
    export_cmd.add_argument("--run-dir", type=Path, required=True)
    export_cmd.add_argument("--out", type=Path, required=True)
    export_cmd.set_defaults(run=run_export)
    return parser


def run_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        config = build_config(args.preset, args.overrides)
    except ValueError as error:
        parser.error(str(error))
    try:
        train(config, resume=args.resume, overwrite=args.overwrite)
    except RunDirError as error:
        parser.error(str(error))


def run_sample(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        print(sample_checkpoint(args.run_dir, args.prompt, args.tokens, args.temperature,
                                args.device))
    except RunDirError as error:
        parser.error(str(error))


def run_export(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        checkpoint = latest_checkpoint(args.run_dir)
    except RunDirError as error:
        parser.error(str(error))
    print(f"wrote {export_model(checkpoint, args.out)} from {checkpoint}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "train":  # overrides may also follow the options
        args.overrides += [arg for arg in extra if not arg.startswith("-")]
        extra = [arg for arg in extra if arg.startswith("-")]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.run(args, parser)


if __name__ == "__main__":
    main()
