"""Command line: ``nsa train``, ``nsa sample``, ``nsa export`` and ``nsa generate``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from nsa.train import TRAIN_PRESETS, build_config, sample_checkpoint, train
from nsa.train.checkpoint import RunDirError, export_model, latest_checkpoint
from nsa.train.config import DEVICES
from nsa.train.errors import SetupError
from nsa.train.tokenizer import TokenizerUnavailableError


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
    start = train_cmd.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true",
                       help="continue from the newest checkpoint in run_dir/checkpoints")
    start.add_argument("--auto-resume", action="store_true",
                       help="resume when run_dir holds a checkpoint, else start fresh "
                            "(for torchrun --max-restarts)")
    start.add_argument("--overwrite", action="store_true",
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

    gen = commands.add_parser(
        "generate", help="stream text from a trained model (KV cache, CUDA graphs on a GPU)")
    gen.add_argument("--model", type=Path, required=True,
                     help="a run directory or a file written by 'nsa export'")
    prompt = gen.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, help="default: the run's sample_prompt")
    prompt.add_argument("--prompt-file", type=Path, default=None)
    gen.add_argument("--max-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--device", default="auto", choices=DEVICES)
    gen.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                     help="auto: bfloat16 on CUDA, float32 on the CPU")
    gen.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                     help="replay each decode step as a CUDA graph (CUDA only)")
    gen.set_defaults(run=run_generate)
    return parser


def run_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Train; a setting, the data, the machine or the run directory that does not fit the run
    is one ``nsa: error:`` line (on every rank under torchrun), not a traceback."""
    try:
        config = build_config(args.preset, args.overrides)
    except ValueError as error:
        parser.error(str(error))
    try:
        resume = "auto" if args.auto_resume else args.resume
        train(config, resume=resume, overwrite=args.overwrite)
    except (RunDirError, SetupError, TokenizerUnavailableError) as error:
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


def run_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    import sys
    import time

    import torch

    from nsa.models.decoding import stream_tokens
    from nsa.train.checkpoint import load_model
    from nsa.train.tokenizer import get_tokenizer
    from nsa.train.trainer import resolve_device

    for name in ("max_tokens", "top_k"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if not args.temperature > 0:
        parser.error(f"--temperature must be > 0, got {args.temperature}")
    try:
        config, model = load_model(args.model)
    except RunDirError as error:
        parser.error(str(error))
    device = resolve_device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = model.to(device=device, dtype=dtype).eval()
    tokenizer = get_tokenizer(config.train.tokenizer)
    text = (args.prompt_file.read_text() if args.prompt_file is not None
            else args.prompt if args.prompt is not None else config.train.sample_prompt)
    prompt = torch.tensor([tokenizer.encode(text)], device=device)
    if prompt.shape[1] + args.max_tokens > config.model.max_seq_len:
        parser.error(f"the prompt ({prompt.shape[1]} tokens) + --max-tokens ({args.max_tokens}) "
                     f"exceed the model's max_seq_len ({config.model.max_seq_len})")
    generator = torch.Generator(device).manual_seed(args.seed)
    sys.stdout.write(text)
    ids, shown = [], ""
    began = time.perf_counter()
    for token in stream_tokens(model, prompt, args.max_tokens, temperature=args.temperature,
                               top_k=args.top_k, top_p=args.top_p, generator=generator,
                               cuda_graph=args.cuda_graphs and device.type == "cuda"):
        ids.append(int(token[0]))
        decoded = tokenizer.decode(ids)  # whole text: multi-byte characters come out whole
        sys.stdout.write(decoded[len(shown):])
        sys.stdout.flush()
        shown = decoded
    elapsed = time.perf_counter() - began
    print(f"\n[{len(ids)} tokens in {elapsed:.2f} s: {len(ids) / elapsed:,.1f} tokens/s]",
          file=sys.stderr)


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
