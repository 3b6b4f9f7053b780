"""lm-evaluation-harness's command line with nsa's models registered (``import nsa.hf``), the
way to evaluate a directory written by ``nsa export --hf`` without remote code:

    python -m nsa.hf.harness --model hf --model_args pretrained=DIR --tasks hellaswag

takes every argument ``lm_eval`` takes (``pip install 'nsa[eval]'``).
"""

import nsa.hf  # noqa: F401  registers the model type "nsa" with transformers' Auto classes

if __name__ == "__main__":
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
