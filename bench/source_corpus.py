"""A corpus of real text on a machine with no network: the Python sources installed with the
interpreter (its standard library and site-packages), one document per file, as JSON lines that
``data=`` and ``bench/quality.py --corpus`` read.

    python bench/source_corpus.py --out /tmp/sources.jsonl --megabytes 64

Files are read in a fixed order, decoded as UTF-8 (others skipped), deduplicated by content
(the same module installed twice counts once), kept when at least ``--min-chars`` long,
shuffled with ``--seed`` and taken until ``--megabytes`` of text; the file is written to a
temporary name and renamed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sysconfig
from pathlib import Path

from nsa.train.checkpoint import atomic_write


def default_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    return sorted({Path(paths["stdlib"]), Path(paths["purelib"])})


def source_documents(roots: list[Path], min_chars: int) -> list[str]:
    """The distinct UTF-8 ``*.py`` files under ``roots`` of at least ``min_chars`` characters,
    in path order."""
    seen, documents = set(), []
    files = sorted({path for root in roots for path in root.rglob("*.py") if path.is_file()})
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        digest = hashlib.sha256(text.encode()).digest()
        if len(text) >= min_chars and digest not in seen:
            seen.add(digest)
            documents.append(text)
    return documents


def build_corpus(roots: list[Path], out: Path, megabytes: float, min_chars: int,
                 seed: int) -> tuple[int, int]:
    """Write the corpus to ``out``; -> (documents, characters) written."""
    documents = source_documents(roots, min_chars)
    random.Random(seed).shuffle(documents)
    budget, taken, chars = megabytes * 1e6, [], 0
    for text in documents:
        if chars >= budget:
            break
        taken.append(text)
        chars += len(text)
    if not taken:
        raise ValueError(f"no Python source of at least {min_chars} characters under "
                         f"{[str(r) for r in roots]}")
    atomic_write(out, lambda file: file.write(
        "".join(json.dumps({"text": text}) + "\n" for text in taken).encode()))
    return len(taken), chars


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--megabytes", type=float, default=64.0)
    parser.add_argument("--roots", type=Path, nargs="+", default=None,
                        help="directories to read (default: the stdlib and site-packages)")
    parser.add_argument("--min-chars", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.megabytes > 0:
        parser.error(f"--megabytes must be > 0, got {args.megabytes}")
    try:
        count, chars = build_corpus(args.roots or default_roots(), args.out, args.megabytes,
                                    args.min_chars, args.seed)
    except ValueError as error:
        parser.error(str(error))
    print(f"wrote {args.out}: {count:,} documents, {chars / 1e6:.1f} M characters")


if __name__ == "__main__":
    main()
