"""Model quality at equal training tokens: NSA, dense attention and NSA's sliding window alone
(``force_branch=win``, the window-only ablation), each trained by the project's trainer on the
same corpus with the same seed, batches and number of steps. Reports validation loss against
training tokens and against wall-clock (a PNG and JSON) and passkey retrieval accuracy
(:mod:`nsa.eval.passkey`) of each trained model.

    python bench/quality.py --tokens 61440 warmup_steps=5 --out /tmp/quality  # tiny, CPU: 1-1.5 min
    python bench/quality.py --preset m7c-125m --corpus /data/text --seq 2048 --tokens 100000000 \\
        --doc-masking --device cuda --passkey-lengths 512,1024,2048 --out /tmp/quality

Corpus (``--corpus``): a directory, glob, .jsonl or .parquet file of documents is read as
``data=`` reads it (the first ``val_docs`` documents are the validation split; override with
``val_docs=N``). A single .txt file (default: the bundled Tiny Shakespeare) is one text: it is cut
at blank lines into documents of at least ``--doc-chars`` characters, shuffled with the seed and
written to OUT/corpus.jsonl, the first tenth held out for validation. Reading documents needs
the ``datasets`` package (``pip install "nsa[train]"``).

Writes OUT/quality.json (settings, validation curves, final losses, passkey cells, each run's
device), OUT/quality.png (needs matplotlib) and each run's directory OUT/<variant>/ (metrics.jsonl,
the final checkpoint; replaced on every call).

A curriculum trains each variant further from its run of an earlier call: ``--init-from DIR``
(that call's OUT) starts variant V from DIR/V's weights (``init_from=``) with a fresh optimizer,
schedule and data position, e.g. at seq 1024, then 2048:

    python bench/quality.py --seq 1024 ... --out /tmp/q1024
    python bench/quality.py --seq 2048 ... --init-from /tmp/q1024 --out /tmp/q2048

Variants too long for one sitting (a GPU call) run apart with ``--variants`` and the same other
arguments; ``--merge`` then joins their quality.json files, refusing any whose settings differ:

    python bench/quality.py --merge run1/quality.json run2/quality.json --out /tmp/quality

Wall-clock is the trainer's ``elapsed_s`` at the step of each validation:
the time since the run's first step, its earlier validations included (each run validates on the
same schedule). The window-only ablation computes all three branches and uses one, so its
wall-clock is NSA's, not a window-attention model's.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from importlib import resources
from pathlib import Path

import torch

from nsa.eval.passkey import (
    check_matplotlib,
    check_passkey_grid,
    passkey_accuracy,
    passkey_table,
)
from nsa.train import build_config, train
from nsa.train.checkpoint import atomic_write, atomic_write_json, checkpoint_dirs, load_model
from nsa.train.distributed import resolve_device
from nsa.train.errors import SetupError
from nsa.train.metrics import METRICS, read_metrics
from nsa.train.passkey import PasskeyText
from nsa.train.tokenizer import TokenizerUnavailableError, get_tokenizer

VARIANTS = {  # name -> the overrides that make it
    "nsa": ["attention=nsa"],
    "dense": ["attention=dense"],
    "nsa-win": ["attention=nsa", "force_branch=win"],
}
BUNDLED_CORPUS = resources.files("nsa.data").joinpath("tiny_shakespeare.txt")


def text_documents(text: str, min_chars: int, seed: int) -> list[str]:
    """``text`` cut at blank lines into documents of consecutive paragraphs, each of at least
    ``min_chars`` characters (the last may be shorter), in an order shuffled by ``seed``."""
    documents, current = [], ""
    for paragraph in text.split("\n\n"):
        current = f"{current}\n\n{paragraph}" if current else paragraph
        if len(current) >= min_chars:
            documents.append(current)
            current = ""
    if current.strip():
        documents.append(current)
    random.Random(seed).shuffle(documents)
    return documents


def corpus_overrides(corpus: Path, out: Path, doc_chars: int, seed: int) -> list[str]:
    """The ``data=`` (and ``val_docs=``) overrides that train on ``corpus``."""
    if corpus.suffix != ".txt":
        return [f"data={corpus}"]
    documents = text_documents(corpus.read_text(encoding="utf-8"), doc_chars, seed)
    if len(documents) < 10:
        raise SetupError(f"--corpus {corpus} makes {len(documents)} documents of "
                         f"--doc-chars={doc_chars}: 10 or more are needed, lower --doc-chars")
    path = out / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in documents))
    return [f"data={path}", f"val_docs={len(documents) // 10}"]


def init_overrides(init_from: Path | None, variant: str) -> list[str]:
    """The ``init_from=`` override that starts ``variant`` from its run in ``init_from`` (an
    earlier call's OUT), if given; ValueError when that run holds no checkpoint."""
    if init_from is None:
        return []
    if not checkpoint_dirs(init_from / variant):
        raise ValueError(f"--init-from {init_from}: no checkpoint of variant {variant} in "
                         f"{init_from / variant}")
    return [f"init_from={init_from / variant}"]


def validation_curve(run_dir: Path, tokens_per_step: int) -> list[dict]:
    """Each validation of a run: step, training tokens, wall-clock (the step's elapsed_s) and
    loss."""
    records = read_metrics(run_dir / METRICS)
    elapsed = {r["step"]: r["elapsed_s"] for r in records if "loss" in r}
    return [{"step": r["step"], "tokens": r["step"] * tokens_per_step,
             "elapsed_s": elapsed[r["step"]], "val_loss": r["val_loss"]}
            for r in records if "val_loss" in r]


def plot(results: dict, path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.2))
    by_tokens, by_time = figure.subplots(1, 2, sharey=True)
    for name, run in results.items():
        curve = run["curve"]
        by_tokens.plot([p["tokens"] for p in curve], [p["val_loss"] for p in curve], marker="o",
                       label=name)
        by_time.plot([p["elapsed_s"] for p in curve], [p["val_loss"] for p in curve], marker="o",
                     label=name)
    by_tokens.set(xlabel="training tokens", ylabel="validation loss (nats/token)")
    by_time.set(xlabel="wall-clock (s)")
    for axes in (by_tokens, by_time):
        axes.grid(True, alpha=0.3)
        axes.legend()
    figure.suptitle(title)
    figure.tight_layout()
    atomic_write(path, lambda file: figure.savefig(file, format="png", dpi=110))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--corpus", type=Path, default=Path(str(BUNDLED_CORPUS)),
                        help="a .txt file, or documents: a directory, glob, .jsonl or .parquet")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seq", type=int, help="training tokens per row and max_seq_len "
                                                "(default: the preset's seq_len)")
    parser.add_argument("--tokens", type=int,
                        help="training tokens per variant (default: the preset's max_steps)")
    parser.add_argument("--evals", type=int, default=4, help="validations per run")
    parser.add_argument("--doc-masking", action="store_true", help="doc_masking=true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--init-from", type=Path, metavar="DIR",
                        help="an earlier call's --out: each variant starts from its run there, "
                             "DIR/<variant> (init_from=)")
    parser.add_argument("--doc-chars", type=int, default=2000,
                        help="the least characters per document cut from a .txt corpus")
    parser.add_argument("--passkey-lengths", help="default: --seq")
    parser.add_argument("--passkey-depths", default="0,50,100")
    parser.add_argument("--passkey-trials", type=int, default=4)
    parser.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                        help="join these quality.json files (one setting, other variants) "
                             "into OUT instead of training")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="more config overrides, the same for every variant")
    args = parser.parse_args(argv)
    if args.merge:
        try:
            check_matplotlib()
            summary = merge_summaries([json.loads(path.read_text()) for path in args.merge],
                                      args.merge)
        except (OSError, ValueError) as error:
            parser.error(str(error))
        args.out.mkdir(parents=True, exist_ok=True)
        report(summary, args.out)
        return
    variants = args.variants.split(",")
    if not set(variants) <= set(VARIANTS):
        parser.error(f"--variants takes comma-separated names of {list(VARIANTS)}")
    try:
        check_matplotlib()
        for flag in ("seq", "tokens", "evals", "doc_chars", "passkey_trials"):
            value = getattr(args, flag)
            if value is not None and value < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
        t = build_config(args.preset, args.overrides).train
        seq = args.seq or t.seq_len
        tokens_per_step = t.batch_size * t.grad_accum * seq
        max_steps = t.max_steps if args.tokens is None else math.ceil(args.tokens /
                                                                      tokens_per_step)
        interval = max(1, max_steps // args.evals)
        common = [f"seq_len={seq}", f"max_seq_len={seq}", f"max_steps={max_steps}",
                  f"eval_interval={interval}", f"log_interval={interval}",
                  f"checkpoint_interval={max_steps}", f"seed={args.seed}", "sample_tokens=0",
                  f"doc_masking={args.doc_masking}", f"device={args.device}"]
        args.out.mkdir(parents=True, exist_ok=True)
        common += corpus_overrides(args.corpus, args.out, args.doc_chars, args.seed)
        configs = {name: build_config(args.preset, [*common, *VARIANTS[name], *args.overrides,
                                                    *init_overrides(args.init_from, name),
                                                    f"run_dir={args.out / name}"])
                   for name in variants}
        lengths = [int(n) for n in (args.passkey_lengths or str(seq)).split(",")]
        depths = [float(d) for d in args.passkey_depths.split(",")]
        tokenizer = get_tokenizer(t.tokenizer)
        check_passkey_grid(PasskeyText(tokenizer), seq, lengths, depths, args.passkey_trials)
    except (SetupError, TokenizerUnavailableError, ValueError) as error:
        parser.error(str(error))
    device = resolve_device(args.device)
    results = {}
    for name, config in configs.items():
        print(f"== {name}: {max_steps} steps of {tokens_per_step:,} tokens", flush=True)
        train(config, overwrite=True)
        _, model, _ = load_model(config.train.run_dir)
        cells = passkey_accuracy(model.to(device), tokenizer, lengths, depths,
                                 args.passkey_trials, args.seed, device=device,
                                 use_autocast=config.train.autocast)
        print(f"passkey accuracy of {name} ({args.passkey_trials} keys per cell):\n"
              f"{passkey_table(cells)}", flush=True)
        results[name] = {"overrides": VARIANTS[name], "parameters": model.num_parameters(),
                         "curve": validation_curve(Path(config.train.run_dir), tokens_per_step),
                         "passkey": [cell.to_dict() for cell in cells],
                         "device": device_name(device)}
    title = (f"{args.preset}, seq {seq}, {max_steps * tokens_per_step:,} tokens, "
             f"{args.corpus.name}{', doc masking' if args.doc_masking else ''}"
             f"{'' if args.init_from is None else f', from {args.init_from}'}")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                if k not in ("variants", "out", "merge")}
    summary = {"title": title, "settings": settings,
               "tokens_per_step": tokens_per_step, "max_steps": max_steps, "runs": results}
    report(summary, args.out)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)


def merge_summaries(summaries: list[dict], paths: list[Path]) -> dict:
    """One summary holding the runs of ``summaries``, which must agree on every setting and
    share no variant (ValueError naming the first file that does not)."""
    first, merged = summaries[0], {}
    keys = ("title", "settings", "tokens_per_step", "max_steps")
    for summary, path in zip(summaries, paths, strict=True):
        if "settings" not in summary:
            raise ValueError(f"{path}: not a quality.json of this bench/quality.py")
        differing = [k for k in keys if summary[k] != first[k]]
        if differing:
            raise ValueError(f"{path}: {', '.join(differing)} differ from {paths[0]}'s: "
                             f"the runs are not comparable")
        repeated = sorted(set(summary["runs"]) & set(merged))
        if repeated:
            raise ValueError(f"{path}: variant(s) {repeated} already in an earlier file")
        merged.update(summary["runs"])
    return {**{k: first[k] for k in keys}, "merged_from": [str(p) for p in paths],
            "runs": merged}


def report(summary: dict, out: Path) -> None:
    """Write OUT/quality.json and OUT/quality.png, and print the table of final results."""
    atomic_write_json(out / "quality.json", summary)
    results, title = summary["runs"], summary["title"]
    plot(results, out / "quality.png", title)
    print(f"\n{title}\n{'variant':<10}{'params':>12}{'val loss':>10}{'wall s':>9}{'passkey':>9}"
          f"  device")
    for name, run in results.items():
        last = run["curve"][-1]
        accuracy = sum(c["accuracy"] for c in run["passkey"]) / len(run["passkey"])
        print(f"{name:<10}{run['parameters']:>12,}{last['val_loss']:>10.4f}"
              f"{last['elapsed_s']:>9.1f}{accuracy:>9.2f}  {run['device']}")
    print(f"wrote {out / 'quality.json'} and {out / 'quality.png'}")


if __name__ == "__main__":
    main()
