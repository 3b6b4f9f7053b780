"""Skip marks for tests of optional dependencies that a machine may lack: CI installs the dev
and eval extras; the GPU machine's image has neither datasets nor lm-eval."""

import importlib.util

import pytest


def needs(module: str, extra: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f'needs {module}: pip install "nsa[{extra}]"')


needs_datasets = needs("datasets", "train")  # local document files (txt, jsonl, parquet), hub
needs_lm_eval = needs("lm_eval", "eval")
