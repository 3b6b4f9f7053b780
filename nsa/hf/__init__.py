"""Hugging Face integration (``pip install 'nsa[hf]'``): ``NSAConfig`` and ``NSAForCausalLM``,
registered with ``AutoConfig`` and ``AutoModelForCausalLM`` as model type ``nsa`` when this
package is imported, and our tokenizers as Hugging Face fast tokenizers.

    import nsa.hf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(DIR)     # written by 'nsa export --hf DIR'
    tokenizer = AutoTokenizer.from_pretrained(DIR)        # needs no import of nsa
"""

from transformers import AutoConfig, AutoModelForCausalLM

from nsa.hf.configuration import NSAConfig
from nsa.hf.modeling import NSAForCausalLM
from nsa.hf.tokenizer import hf_tokenizer

AutoConfig.register(NSAConfig.model_type, NSAConfig, exist_ok=True)
AutoModelForCausalLM.register(NSAConfig, NSAForCausalLM, exist_ok=True)

__all__ = ["NSAConfig", "NSAForCausalLM", "hf_tokenizer"]
