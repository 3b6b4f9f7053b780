"""Command line: ``nsa train``, ``nsa sample``, ``nsa export``, ``nsa generate`` and
``nsa eval``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from nsa.models.decoding import check_sampling, stream_tokens
from nsa.train import TRAIN_PRESETS, build_config, sample_checkpoint, train
from nsa.train.checkpoint import ModelFileError, RunDirError, export_model, latest_checkpoint
from nsa.train.config import DEVICES
from nsa.train.errors import SetupError
from nsa.train.tokenizer import TokenizerUnavailableError

# The sampling settings' names as the user types them, for check_sampling's messages.
SAMPLE_FLAGS = {"max_new_tokens": "--tokens", "temperature": "--temperature"}
GENERATE_FLAGS = {"max_new_tokens": "--max-tokens", "temperature": "--temperature",
                  "top_k": "--top-k", "top_p": "--top-p"}
EVAL_TASKS = ("perplexity", "passkey")
# nsa eval's options that belong to one task: given without it, they are refused.
EVAL_TASK_FLAGS = {"files": "perplexity", "seq": "perplexity", "passkey_lengths": "passkey",
                   "passkey_depths": "passkey", "passkey_trials": "passkey", "heatmap": "passkey"}
PASSKEY_DEPTHS = "0,25,50,75,100"
PASSKEY_TRIALS = 10


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: '--resum' must not silently mean '--resume'.
    parser = argparse.ArgumentParser(prog="nsa", description="Native Sparse Attention",
                                     allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True)

    train_cmd = commands.add_parser(
        "train", help="train a language model on the bundled corpus", allow_abbrev=False,
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

    sample_cmd = commands.add_parser("sample", help="print a sample from a trained checkpoint",
                                     allow_abbrev=False)
    sample_cmd.add_argument("--run-dir", type=Path, required=True,
                            help="a run directory, or a model file or directory written by "
                                 "'nsa export'")
    sample_cmd.add_argument("--prompt", default=None, help="default: the run's sample_prompt")
    sample_cmd.add_argument("--tokens", type=int, default=None, help="bytes to generate")
    sample_cmd.add_argument("--temperature", type=float, default=None)
    sample_cmd.add_argument("--device", default="auto", choices=DEVICES)
    sample_cmd.set_defaults(run=run_sample)

    export_cmd = commands.add_parser(
        "export", help="write a run's newest checkpoint as one model file (no optimizer), or "
                       "as a Hugging Face directory", allow_abbrev=False)
    export_cmd.add_argument("--run-dir", type=Path, required=True)
    target = export_cmd.add_mutually_exclusive_group(required=True)
    target.add_argument("--out", type=Path, help="the model file to write")
    target.add_argument("--hf", type=Path, metavar="DIR",
                        help="a new directory for transformers' from_pretrained: config.json, "
                             "model.safetensors and the tokenizer (needs nsa[hf])")
    export_cmd.set_defaults(run=run_export)

    gen = commands.add_parser(
        "generate", help="stream text from a trained model (KV cache, CUDA graphs on a GPU)",
        allow_abbrev=False)
    gen.add_argument("--model", type=Path, required=True,
                     help="a run directory, or a file or directory written by 'nsa export'")
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

    ev = commands.add_parser(
        "eval", help="perplexity on held-out text, passkey retrieval", allow_abbrev=False,
        description="Evaluate a run directory, a model file or a Hugging Face directory written "
                    "by 'nsa export'. Perplexity: non-overlapping windows of --seq tokens, "
                    "nats and bits per token, bits per byte. Passkey: a key planted in filler "
                    "text at each depth, asked for at the end of a context of each length "
                    "(in the model's tokens), answered greedily; accuracy per cell.")
    ev.add_argument("--model", type=Path, required=True,
                    help="a run directory, or a file or directory written by 'nsa export'")
    ev.add_argument("--tasks", default="perplexity",
                    help="comma-separated: perplexity, passkey (default: perplexity)")
    ev.add_argument("--files", nargs="+", metavar="PATH",
                    help="held-out .txt/.jsonl/.parquet files, directories or globs, a document "
                         "each (a .txt file) or per line/row (default: the run's validation "
                         "split)")
    ev.add_argument("--seq", type=int, help="tokens per window (default: the run's seq_len)")
    ev.add_argument("--passkey-lengths", metavar="L,...",
                    help="context lengths in tokens (default: the model's max_seq_len)")
    ev.add_argument("--max-seq-len", type=int, metavar="N",
                    help="evaluate as if the model's max_seq_len were N (> its own): contexts "
                         "past the length it was trained to, to measure extrapolation")
    ev.add_argument("--passkey-depths", metavar="D,...",
                    help=f"needle depths in percent (default: {PASSKEY_DEPTHS})")
    ev.add_argument("--passkey-trials", type=int,
                    help=f"keys per cell (default: {PASSKEY_TRIALS})")
    ev.add_argument("--heatmap", type=Path, metavar="PNG",
                    help="draw passkey accuracy as a heat map (needs matplotlib)")
    ev.add_argument("--seed", type=int, default=0, help="the passkey keys' seed")
    ev.add_argument("--batch-size", type=int, default=8,
                    help="windows or passkey prompts per forward pass")
    ev.add_argument("--device", default="auto", choices=DEVICES)
    ev.add_argument("--json", type=Path, metavar="PATH", help="also write the results here")
    ev.set_defaults(run=run_eval)
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
    given = {"max_new_tokens": args.tokens, "temperature": args.temperature}
    try:
        check_sampling(**{k: v for k, v in given.items() if v is not None}, names=SAMPLE_FLAGS)
        if args.prompt == "":
            raise ValueError("--prompt must not be empty")
        print(sample_checkpoint(args.run_dir, args.prompt, args.tokens, args.temperature,
                                args.device))
    except (RunDirError, ModelFileError, ValueError) as error:
        parser.error(str(error))


def run_export(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        if args.hf is not None:
            try:
                from nsa.hf.export import export_hf
            except ImportError as error:
                raise ModelFileError(f"--hf needs the hf extra: pip install 'nsa[hf]' "
                                     f"({error})") from None
        checkpoint = latest_checkpoint(args.run_dir)
        written = (export_model(checkpoint, args.out) if args.hf is None
                   else export_hf(checkpoint, args.hf))
        print(f"wrote {written} from {checkpoint}")
    except (RunDirError, ModelFileError, TokenizerUnavailableError) as error:
        parser.error(str(error))


def read_prompt_file(path: Path) -> str:
    """The text of ``--prompt-file``; ``ValueError`` when missing, unreadable, not UTF-8 or
    empty."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--prompt-file {path} is not UTF-8 text") from None
    except OSError as error:
        raise ValueError(f"--prompt-file {path}: {error.strerror or error}") from None
    if not text:
        raise ValueError(f"--prompt-file {path} is empty")
    return text


def run_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    import sys
    import time

    import torch

    from nsa.train.checkpoint import load_model
    from nsa.train.tokenizer import get_tokenizer
    from nsa.train.trainer import resolve_device

    try:
        check_sampling(max_new_tokens=args.max_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, names=GENERATE_FLAGS)
        if args.prompt == "":
            raise ValueError("--prompt must not be empty")
        text = read_prompt_file(args.prompt_file) if args.prompt_file is not None else args.prompt
        device = resolve_device(args.device)
        config, model, _ = load_model(args.model)
        if text is None:
            text = config.train.sample_prompt
        if not text:
            raise ValueError("the model's sample_prompt is empty: give --prompt")
    except (RunDirError, ModelFileError, ValueError) as error:
        parser.error(str(error))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = model.to(device=device, dtype=dtype).eval()
    tokenizer = get_tokenizer(config.train.tokenizer)
    prompt = torch.tensor([tokenizer.encode(text)], device=device)
    if prompt.shape[1] > config.model.max_seq_len:
        print(f"[the prompt has {prompt.shape[1]} tokens: the model reads its last "
              f"{config.model.max_seq_len} (max_seq_len)]", file=sys.stderr)
    generator = torch.Generator(device).manual_seed(args.seed)
    sys.stdout.write(text)
    ids, shown = [], ""
    began = time.perf_counter()
    for token in stream_tokens(model, prompt, args.max_tokens, temperature=args.temperature,
                               top_k=args.top_k, top_p=args.top_p, generator=generator,
                               cuda_graph=args.cuda_graphs and device.type == "cuda"):
        ids.append(int(token[0]))
        if len(ids) == 1:  # the prompt is prefilled (and a CUDA graph captured)
            first = time.perf_counter()
        decoded = tokenizer.decode(ids)  # whole text: multi-byte characters come out whole
        sys.stdout.write(decoded[len(shown):])
        sys.stdout.flush()
        shown = decoded
    done = time.perf_counter()
    elapsed = done - began
    decoding = (f", then {(len(ids) - 1) / (done - first):,.1f} tokens/s decoding"
                if len(ids) > 1 else "")
    print(f"\n[{len(ids)} tokens in {elapsed:.2f} s: {len(ids) / elapsed:,.1f} tokens/s; "
          f"prompt of {min(prompt.shape[1], config.model.max_seq_len)} tokens prefilled in "
          f"{first - began:.2f} s{decoding}]", file=sys.stderr)


def parse_numbers(flag: str, text: str, kind: type) -> list:
    """'2048,4096' -> [2048, 4096]; ValueError naming ``flag`` for anything else."""
    try:
        return [kind(item) for item in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated {kind.__name__}s, got {text!r}") from None


def check_writable(flag: str, path: Path | None) -> None:
    """ValueError unless ``path`` (when given) can be a new file: its directory exists."""
    if path is not None and (path.is_dir() or not path.parent.is_dir()):
        raise ValueError(f"{flag} {path}: not a file path in an existing directory")


def with_longer_context(config, model, max_seq_len: int):
    """(config, model) that read up to ``max_seq_len`` tokens with ``model``'s weights (no weight
    depends on max_seq_len), for evaluating past the length the model was trained to."""
    from dataclasses import replace

    from nsa.models import LanguageModel

    trained = config.model.max_seq_len
    if max_seq_len <= trained:
        raise ValueError(f"--max-seq-len must exceed the model's max_seq_len ({trained}), got "
                         f"{max_seq_len}")
    model_config = replace(config.model, max_seq_len=max_seq_len)
    longer = LanguageModel(model_config)
    longer.load_state_dict(model.state_dict())
    print(f"max_seq_len {trained} -> {max_seq_len} for this evaluation: positions past "
          f"{trained} were not trained", flush=True)
    return replace(config, model=model_config), longer


def run_eval(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Every check comes before the model runs: a bad flag, path, length or depth, a missing
    matplotlib for --heatmap, data that cannot be read, each is one ``nsa: error:`` line."""
    import math

    from nsa.eval.passkey import (
        check_matplotlib,
        check_passkey_grid,
        passkey_accuracy,
        passkey_table,
        save_heatmap,
    )
    from nsa.eval.perplexity import file_texts, perplexity, validation_texts
    from nsa.train.checkpoint import atomic_write_json, load_model
    from nsa.train.passkey import PasskeyText
    from nsa.train.tokenizer import get_tokenizer
    from nsa.train.trainer import check_attention_backend, resolve_device

    try:
        tasks = args.tasks.split(",")
        if not tasks or not set(tasks) <= set(EVAL_TASKS):
            raise ValueError(f"--tasks takes comma-separated tasks of {EVAL_TASKS}, got "
                             f"{args.tasks!r}")
        for name, task in EVAL_TASK_FLAGS.items():
            if getattr(args, name) is not None and task not in tasks:
                raise ValueError(f"--{name.replace('_', '-')} applies to --tasks {task}")
        lengths = (None if args.passkey_lengths is None
                   else parse_numbers("--passkey-lengths", args.passkey_lengths, int))
        depths = parse_numbers("--passkey-depths", PASSKEY_DEPTHS if args.passkey_depths is None
                               else args.passkey_depths, float)
        if not all(math.isfinite(depth) for depth in depths):
            raise ValueError(f"--passkey-depths must be finite, got {args.passkey_depths!r}")
        trials = PASSKEY_TRIALS if args.passkey_trials is None else args.passkey_trials
        if args.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
        check_writable("--json", args.json)
        check_writable("--heatmap", args.heatmap)
        if args.heatmap is not None:
            check_matplotlib()
        if not args.model.exists():
            raise ValueError(f"--model {args.model}: no such file or directory")
        device = resolve_device(args.device)
        config, model, _ = load_model(args.model)
        if args.max_seq_len is not None:
            config, model = with_longer_context(config, model, args.max_seq_len)
        check_attention_backend(config.model, device)
        t = config.train
        tokenizer = get_tokenizer(t.tokenizer)
        max_seq_len = config.model.max_seq_len
        seq = t.seq_len if args.seq is None else args.seq
        if not 1 <= seq <= max_seq_len:
            raise ValueError(f"--seq must be in [1, max_seq_len={max_seq_len}], got {seq}")
        lengths = lengths or [max_seq_len]
        if "passkey" in tasks:
            check_passkey_grid(PasskeyText(tokenizer), max_seq_len, lengths, depths, trials)
        model = model.to(device)
        results = {"model": str(args.model), "tokenizer": t.tokenizer}
        if "perplexity" in tasks:
            texts = file_texts(args.files, tokenizer) if args.files else validation_texts(
                t, tokenizer)
            source = (f"files {' '.join(args.files)}" if args.files
                      else f"the validation split of data={t.data}")
            result = perplexity(model, tokenizer, texts, seq, batch_size=args.batch_size,
                                device=device, use_autocast=t.autocast,
                                doc_masking=t.doc_masking)
            results["perplexity"] = {"source": source, **result.to_dict()}
            print(f"perplexity on {source}: {result.tokens:,} tokens ({result.bytes:,} bytes) in "
                  f"windows of {seq}: {result.nats_per_token:.4f} nats/token, "
                  f"{result.bits_per_token:.4f} bits/token, {result.bits_per_byte:.4f} "
                  f"bits/byte, perplexity {result.perplexity:.2f}")
        if "passkey" in tasks:
            cells = passkey_accuracy(model, tokenizer, lengths, depths, trials, args.seed,
                                     batch_size=args.batch_size, device=device,
                                     use_autocast=t.autocast)
            results["passkey"] = {"seed": args.seed, "cells": [c.to_dict() for c in cells]}
            print(f"passkey accuracy ({trials} keys per cell, seed {args.seed}):")
            print(passkey_table(cells))
            if args.heatmap is not None:
                save_heatmap(cells, args.heatmap, f"passkey retrieval: {args.model.name}")
                print(f"wrote {args.heatmap}")
    except (RunDirError, ModelFileError, SetupError, TokenizerUnavailableError,
            ValueError) as error:
        parser.error(str(error))
    if args.json is not None:
        atomic_write_json(args.json, results)
        print(f"wrote {args.json}")


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
