"""Command line: ``nsa train`` and ``nsa sample``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from nsa.train import TRAIN_PRESETS, build_config, sample_checkpoint, train
from nsa.train.checkpoint import RunDirError
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
                           help="continue from run_dir/checkpoint.pt")
    train_cmd.add_argument("overrides", nargs="*", metavar="key=value")

    sample_cmd = commands.add_parser("sample", help="print a sample from a trained checkpoint")
    sample_cmd.add_argument("--run-dir", type=Path, required=True)
    sample_cmd.add_argument("--prompt", default=None, help="default: the run's sample_prompt")
    sample_cmd.add_argument("--tokens", type=int, default=None, help="bytes to generate")
    sample_cmd.add_argument("--temperature", type=float, default=None)
    sample_cmd.add_argument("--device", default="auto", choices=DEVICES)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)  # overrides may also follow the options
    unknown = [arg for arg in extra if args.command != "train" or arg.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if args.command == "train":
            train(build_config(args.preset, [*args.overrides, *extra]), resume=args.resume)
        else:
            print(sample_checkpoint(args.run_dir, args.prompt, args.tokens, args.temperature,
                                    args.device))
    except (RunDirError, ConfigError) as error:
        parser.error(str(error))

if __name__ == "__main__":
    main()
