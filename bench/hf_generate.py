"""Decoding speed through Hugging Face ``generate`` against ``nsa generate``'s loop, same model,
prompt and length, in one run; and whether their greedy tokens agree.

The model is loaded with ``AutoModelForCausalLM.from_pretrained(DIR, dtype=bfloat16,
device_map="cuda")``: ``--model DIR`` (written by ``nsa export --hf``), or a preset with random
weights saved to a temporary directory first. Three timings per attention:

* ``nsa generate``: ``stream_tokens`` on the wrapped LanguageModel with a CUDA graph per decode
  step, each token read back to the host as it comes (what ``nsa generate`` does);
* ``HF generate``: ``model.generate(max_new_tokens=N, do_sample=False)`` with no end-of-text
  stop (nothing to check per step);
* ``HF generate + eos check``: the same with an ``eos_token_id`` the run does not produce, so
  every step checks for it (a host sync per token, as with a real end-of-text id).

    python bench/hf_generate.py                          # m7c-125m, NSA and dense, on CUDA
    python bench/hf_generate.py --model runs/m7c-hf --attention nsa
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from nsa.hf import NSAConfig, NSAForCausalLM
from nsa.models import model_preset
from nsa.models.decoding import stream_tokens
from nsa.train.checkpoint import atomic_write_json


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(run) -> tuple[float, torch.Tensor]:
    synchronize()
    began = time.perf_counter()
    tokens = run()
    synchronize()
    return time.perf_counter() - began, tokens


def nsa_loop(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``nsa generate``'s loop: greedy, a CUDA graph per step, each token to the host."""
    out = []
    for token in stream_tokens(model, prompt, new_tokens, top_k=1,
                               cuda_graph=prompt.device.type == "cuda"):
        out.append(int(token[0]))
    return torch.tensor([out], device=prompt.device)


def measure(model, prompt: torch.Tensor, new_tokens: int, repeats: int) -> dict:
    vocab = model.config.vocab_size
    runs = {
        "nsa generate": lambda: nsa_loop(model.model, prompt, new_tokens),
        "HF generate": lambda: model.generate(
            prompt, max_new_tokens=new_tokens, do_sample=False,
            eos_token_id=None)[:, prompt.shape[1]:],
        "HF generate + eos check": lambda: model.generate(
            prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=vocab - 1,
            pad_token_id=vocab - 1)[:, prompt.shape[1]:],
    }
    rates, tokens = {}, {}
    for name, run in runs.items():
        run()  # warm-up: Triton compilation, allocator, first graph capture
        seconds = []
        for _ in range(repeats):
            elapsed, tokens[name] = timed(run)
            seconds.append(elapsed / tokens[name].shape[1])
        rates[name] = 1 / statistics.median(seconds)
    first = tokens["nsa generate"]
    return {"tokens_per_s": rates,
            "same_tokens": {k: bool(torch.equal(v, first[:, :v.shape[1]]))
                            for k, v in tokens.items()},
            "generated": {k: v.shape[1] for k, v in tokens.items()}}


def load(directory: str, device: str):
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16,
                                                device_map=device).eval()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a directory from 'nsa export --hf'")
    parser.add_argument("--preset", default="m7c-125m", help="random weights, without --model")
    parser.add_argument("--attention", default="nsa,dense", help="with --preset")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args(argv)

    name = (torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu")
    print(f"# {name}, torch {torch.__version__}, bf16, B=1, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, greedy, median of {args.repeats}")
    print("| model | nsa generate tok/s | HF generate tok/s | HF + eos check tok/s | "
          "HF / nsa | same tokens |")
    print("|---|---|---|---|---|---|")
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        if args.model:
            models = {args.model: args.model}
        else:
            models = {}
            for attention in args.attention.split(","):
                torch.manual_seed(0)
                config = NSAConfig.from_model_config(model_preset(args.preset, kind=attention))
                models[f"{args.preset} {attention}"] = path = os.path.join(scratch, attention)
                NSAForCausalLM(config).save_pretrained(path)
        for label, path in models.items():
            model = load(path, args.device)
            generator = torch.Generator().manual_seed(0)
            prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len),
                                   generator=generator).to(model.device)
            r = measure(model, prompt, args.new_tokens, args.repeats)
            rate = r["tokens_per_s"]
            ratio = rate["HF generate"] / rate["nsa generate"]
            print(f"| {label} | {rate['nsa generate']:,.1f} | {rate['HF generate']:,.1f} | "
                  f"{rate['HF generate + eos check']:,.1f} | {ratio:.2f} | "
                  f"{all(r['same_tokens'].values())} |", flush=True)
            results.append({"model": label, **r})
            del model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if args.out:
        atomic_write_json(Path(args.out) / "hf_generate.json",
                          {"device": name, "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
