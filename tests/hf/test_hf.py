"""Hugging Face integration: NSAForCausalLM computes LanguageModel's logits and tokens,
save_pretrained / from_pretrained round-trip, 'nsa export --hf' writes a directory that
transformers, lm-evaluation-harness and our own CLI load, our tokenizers as HF tokenizers encode
exactly as ours, and corrupted weights are refused."""

import contextlib
import io
import json
import os
import random
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="needs the hf extra (pip install 'nsa[hf]')")
from transformers import AutoModelForCausalLM  # noqa: E402

import nsa.cli
import nsa.hf
from nsa.config_tree import replace_fields
from nsa.hf import NSAConfig, NSAForCausalLM, hf_tokenizer
from nsa.hf.tokenizer import byte_level_bpe
from nsa.models import model_preset
from nsa.train.checkpoint import (
    ModelFileError,
    latest_checkpoint,
    load_model,
    model_from_checkpoint,
)
from nsa.train.tokenizer import ByteTokenizer, TokenizerUnavailableError, get_tokenizer
from tests.optional import needs_datasets, needs_lm_eval

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny ops: threads only wait
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TEXTS = ["ROMEO:", "héllo wörld 🙂", "a\x00b", "  two  spaces\n\ttab", "Ā", "<|endoftext|>x",
         "don't  I'll   ", "1234 56789"]


def small_config(kind: str, max_seq_len: int = 64):
    return replace_fields(model_preset("tiny"), kind=kind, max_seq_len=max_seq_len, dim=32,
                          num_heads=4, num_kv_heads=2, head_dim_k=8, head_dim_v=8, cmp_block=8,
                          cmp_stride=4, sel_block=8, num_selected=3, window=12)


def hf_model(kind: str, max_seq_len: int = 64, eos: int | None = 0) -> NSAForCausalLM:
    """A model with weights of std 1 (the next token depends on the context; the training
    init's 0.02 gives near-uniform logits), in float32."""
    torch.manual_seed(0)
    model = NSAForCausalLM(NSAConfig.from_model_config(small_config(kind, max_seq_len),
                                                       eos_token_id=eos)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 1)
    return model


@pytest.fixture(scope="module")
def hf_dir(run_dir):
    out = run_dir.parent / "tiny-hf"
    nsa.cli.main(["export", "--run-dir", str(run_dir), "--hf", str(out)])
    return out


@pytest.mark.parametrize("kind", ["nsa", "dense"])
def test_logits_and_loss_equal_the_language_model(kind):
    model = hf_model(kind)
    tokens = torch.randint(0, 256, (2, 50))
    with torch.no_grad():
        out = model(tokens, labels=tokens)
        assert torch.equal(out.logits, model.model(tokens))
        expected = model.model(tokens[:, :-1], tokens[:, 1:])
    torch.testing.assert_close(out.loss, expected)
    assert model.dtype == torch.float32 and model.config.model_config.attention.kind == kind


def test_the_hf_config_is_the_model_config_tree():
    tree = small_config("dense")
    config = NSAConfig.from_model_config(tree, eos_token_id=0)
    assert config.model_config == tree and config.to_dict()["attention"]["nsa"]["window"] == 12
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.max_position_embeddings) == (32, 2, 4, 2, 64)
    by_name = NSAConfig(num_hidden_layers=3, kind="nsa", window=24, tie_word_embeddings=False)
    assert by_name.model_config == replace_fields(NSAConfig().model_config, num_layers=3,
                                                  window=24, tie_embeddings=False)
    with pytest.raises(ValueError, match="num_selected"):
        NSAConfig(num_selected=1)  # < num_init + num_local, refused when the config is built


@pytest.mark.parametrize("kind", ["nsa", "dense"])
def test_save_pretrained_round_trips(kind, tmp_path):
    model = hf_model(kind)
    model.save_pretrained(tmp_path / "a")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert type(loaded) is NSAForCausalLM
    assert loaded.config.model_config == model.config.model_config
    assert loaded.model.head.weight is loaded.model.embed.weight  # tied again
    tokens = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.bfloat16)
    with torch.no_grad():  # as 'nsa generate --dtype bfloat16' casts the model
        assert torch.equal(half(tokens).logits, model.to(torch.bfloat16)(tokens).logits)
    loaded.save_pretrained(tmp_path / "b")
    again = NSAForCausalLM.from_pretrained(tmp_path / "b")
    for (name, a), (_, b) in zip(loaded.state_dict().items(), again.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kind", ["nsa", "dense"])
def test_greedy_generate_equals_model_generate(kind):
    """Token for token, past max_seq_len (32) too, where both follow our context rule."""
    model = hf_model(kind, max_seq_len=32)
    prompt = torch.randint(1, 256, (2, 10))
    ours = model.model.generate(prompt, 60, top_k=1)
    assert torch.equal(model.generate(prompt, max_new_tokens=60, eos_token_id=None), ours)
    assert torch.equal(model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                      max_length=70, do_sample=False, eos_token_id=None), ours)


def test_generate_stops_at_eos_and_pads_finished_sequences():
    model = hf_model("nsa")
    prompt = torch.randint(1, 256, (2, 6))
    ours = model.model.generate(prompt, 40, top_k=1)[:, 6:]
    eos = int(ours[0, 3])  # sequence 0 ends at its 4th new token
    out = model.generate(prompt, max_new_tokens=40, eos_token_id=eos, pad_token_id=255)[:, 6:]
    ends = [ours[b].tolist().index(eos) + 1 if eos in ours[b] else 40 for b in range(2)]
    assert out.shape[1] == max(ends)  # stops once every sequence has ended
    for b, end in enumerate(ends):
        assert torch.equal(out[b, :end], ours[b, :end]) and (out[b, end:] == 255).all()


def test_sampling_settings_reach_our_sampler():
    model = hf_model("nsa")
    prompt = torch.randint(1, 256, (1, 6))
    torch.manual_seed(1)
    out = model.generate(prompt, max_new_tokens=30, do_sample=True, temperature=0.7,
                         top_k=20, top_p=0.9, eos_token_id=None)
    torch.manual_seed(1)
    ours = model.model.generate(prompt, 30, temperature=0.7, top_k=20, top_p=0.9)
    assert torch.equal(out, ours)


@pytest.mark.parametrize("arguments,named", [
    (dict(attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])), "attention_mask"),
    (dict(num_beams=2), "num_beams"),
    (dict(repetition_penalty=1.3), "repetition_penalty"),
    (dict(return_dict_in_generate=True), "return_dict_in_generate"),
    (dict(logits_processor=[lambda ids, scores: scores]), "logits_processor"),
    (dict(max_new_tokens=None, max_length=3), "max_length"),
    (dict(do_sample=True, temperature=0.0), "temperature"),
])
def test_generate_refuses_what_our_cache_loop_cannot_do(arguments, named):
    model = hf_model("nsa")
    with pytest.raises(ValueError, match=named):
        model.generate(torch.randint(0, 256, (2, 4)), **{"max_new_tokens": 3, **arguments})


def test_forward_takes_right_padding_and_refuses_left_padding():
    model = hf_model("nsa")
    tokens = torch.randint(0, 256, (2, 12))
    right = torch.ones(2, 12, dtype=torch.long)
    right[1, 8:] = 0
    with torch.no_grad():
        assert torch.equal(model(tokens, attention_mask=right).logits, model.model(tokens))
        with pytest.raises(ValueError, match="right padding"):
            model(tokens, attention_mask=right.flip(1))
        with pytest.raises(ValueError, match="past_key_values"):
            model(tokens, past_key_values=object())
        with pytest.raises(ValueError, match="output_hidden_states"):
            model(tokens, output_hidden_states=True)


def test_nsa_export_hf_writes_a_directory_transformers_loads(run_dir, hf_dir):
    names = {p.name for p in hf_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "manifest.json"} <= names
    config = json.loads((hf_dir / "config.json").read_text())
    run_config, checkpoint_model, _ = model_from_checkpoint(latest_checkpoint(run_dir))
    assert config["model_type"] == "nsa" and config["train"]["tokenizer"] == "bytes"
    assert config["attention"]["nsa"]["window"] == run_config.model.attention.nsa.window
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    tokens = torch.randint(0, 256, (1, 100))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, checkpoint_model(tokens))
    assert load_model(hf_dir)[0] == run_config  # what nsa generate / nsa sample read


def test_exported_byte_tokenizer_loads_without_nsa_and_is_exact(hf_dir):
    """AutoTokenizer.from_pretrained(DIR) in a fresh process that never imports nsa."""
    script = (f"import json, sys\nfrom transformers import AutoTokenizer\n"
              f"t = AutoTokenizer.from_pretrained({str(hf_dir)!r})\n"
              f"texts = json.loads(sys.stdin.read())\n"
              f"print(json.dumps([[t.encode(x, add_special_tokens=False) for x in texts], "
              f"t.decode([0, 104, 255, 195]), t.eos_token_id, 'nsa' in sys.modules]))")
    run = subprocess.run([sys.executable, "-c", script], input=json.dumps(TEXTS),
                         capture_output=True, text=True, env={**os.environ, **OFFLINE},
                         timeout=300)
    assert run.returncode == 0, run.stderr
    encoded, decoded, eos, imported_nsa = json.loads(run.stdout)
    ours = ByteTokenizer()
    assert encoded == [ours.encode(x) for x in TEXTS]
    assert decoded == ours.decode([0, 104, 255, 195]) and eos == ours.eot and not imported_nsa


def test_byte_tokenizer_decodes_invalid_utf8_as_ours():
    tokenizer, ours = hf_tokenizer("bytes", 128), ByteTokenizer()
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(256) for _ in range(rng.randint(1, 12))]
        assert tokenizer.decode(ids) == ours.decode(ids), ids
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == ours.encode(text)


def shakespeare() -> str:
    return (files("nsa.data") / "tiny_shakespeare.txt").read_text()


def test_bpe_conversion_encodes_as_tiktoken_offline():
    """A BPE trained here (tiktoken's own trainer, GPT-2's pattern) converted to a tokenizers
    BPE: every sample encodes to tiktoken's ids and decodes back; no download needed."""
    import tiktoken
    from tiktoken._educational import bpe_train

    pattern = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    text = shakespeare()
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer prints every merge
        ranks = bpe_train(text[:6000] + " héllo wörld 🙂", 256 + 120, pattern)
    special = {"<|endoftext|>": len(ranks)}
    encoding = tiktoken.Encoding("toy", pat_str=pattern, mergeable_ranks=ranks,
                                 special_tokens=special)
    converted = byte_level_bpe(ranks, pattern, special)
    rng = random.Random(0)
    starts = [rng.randrange(len(text)) for _ in range(500)]
    samples = TEXTS + [text[i:i + rng.randint(1, 300)] for i in starts]
    for sample in samples:
        ids = encoding.encode_ordinary(sample)
        assert converted.encode(sample).ids == ids, sample
        assert converted.decode(ids) == sample


def gpt2_or_skip():
    try:
        return get_tokenizer("gpt2")
    except TokenizerUnavailableError:
        pytest.skip("tiktoken's gpt2 files are neither cached (TIKTOKEN_CACHE_DIR) nor "
                    "downloadable here")


def test_gpt2_tokenizer_is_exact():
    ours = gpt2_or_skip()
    tokenizer = hf_tokenizer("gpt2", 2048)
    assert tokenizer.eos_token_id == ours.eot == 50256
    text = shakespeare()
    rng = random.Random(0)
    samples = TEXTS + [text[i:i + rng.randint(1, 300)]
                       for i in (rng.randrange(len(text)) for _ in range(300))]
    for sample in samples:
        ids = ours.encode(sample)
        assert tokenizer.encode(sample, add_special_tokens=False) == ids, sample
        assert tokenizer.decode(ids) == ours.decode(ids)


def test_nsa_generate_and_sample_read_the_directory(run_dir, hf_dir, capsys):
    outputs = []
    for model in (run_dir, hf_dir):
        nsa.cli.main(["generate", "--model", str(model), "--prompt", "JULIET:",
                      "--max-tokens", "40", "--top-k", "1"])
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].startswith("JULIET:")
    nsa.cli.main(["sample", "--run-dir", str(hf_dir), "--tokens", "10"])
    assert capsys.readouterr().out.startswith("ROMEO:")


@needs_datasets
def test_nsa_eval_reads_the_directory(run_dir, hf_dir, tmp_path, capsys):
    (tmp_path / "held_out.txt").write_text("JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n")
    results = []
    for model in (run_dir, hf_dir):
        out = tmp_path / f"{model.name}.json"
        nsa.cli.main(["eval", "--model", str(model), "--files", str(tmp_path / "held_out.txt"),
                      "--tasks", "perplexity,passkey", "--passkey-lengths", "128",
                      "--passkey-depths", "0,100", "--passkey-trials", "2", "--json", str(out)])
        results.append(json.loads(out.read_text()))
    capsys.readouterr()
    assert results[0]["perplexity"] == results[1]["perplexity"]
    assert results[0]["passkey"] == results[1]["passkey"]


def test_export_refuses_a_directory_that_is_not_empty(run_dir, hf_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        nsa.cli.main(["export", "--run-dir", str(run_dir), "--hf", str(hf_dir)])
    assert exit_info.value.code == 2
    assert "nsa: error: DIR exists and is not an empty directory" in (
        capsys.readouterr().err.replace(str(hf_dir), "DIR"))
    assert load_model(hf_dir)  # untouched


def flip_bytes(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    for offset in (len(raw) // 2, len(raw) - 7):
        raw[offset] ^= 0x5A
    path.write_bytes(bytes(raw))


CORRUPTIONS = {
    "flipped-weight-bytes": flip_bytes,
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:p.stat().st_size // 2]),
    "text": lambda p: p.write_text("not weights"),
}


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
@pytest.mark.parametrize("damage", CORRUPTIONS)
def test_a_corrupted_model_safetensors_is_refused(damage, manifest, tmp_path):
    hf_model("nsa").save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    if not manifest:
        if damage == "flipped-weight-bytes":
            pytest.skip("without the manifest, flipped weight bytes are valid safetensors")
        (tmp_path / "manifest.json").unlink()
    CORRUPTIONS[damage](weights)
    for load in (AutoModelForCausalLM.from_pretrained, load_model):
        with pytest.raises(ModelFileError, match=str(tmp_path)) as refused:
            load(tmp_path)
        if manifest:
            assert "model.safetensors" in str(refused.value)


def test_weights_that_do_not_fit_the_config_are_refused(tmp_path):
    hf_model("nsa").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_layers"] = 3  # the file holds 2 layers
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match="missing_keys: model.blocks.2"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


LM_EVAL = """
import json, sys
import nsa.hf  # registers the model type nsa
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

lm = HFLM(pretrained=sys.argv[1], device="cpu", batch_size=2, dtype="float32")
pairs = json.loads(sys.argv[2])
scores = lm.loglikelihood([Instance("loglikelihood", {}, tuple(p), i)
                           for i, p in enumerate(pairs)], disable_tqdm=True)
text = lm.generate_until([Instance("generate_until", {}, (
    "JULIET:", {"until": ["\\n\\n"], "max_gen_toks": 24, "do_sample": False}), 0)],
    disable_tqdm=True)
print(json.dumps({"scores": scores, "text": text, "max_length": lm.max_length}))
"""


@needs_lm_eval
def test_lm_eval_huggingface_wrapper_scores_and_generates(hf_dir, run_dir):
    """lm-evaluation-harness's HFLM, as 'lm_eval --model hf --model_args pretrained=DIR'
    builds it, offline, in a fresh process: log-likelihoods (a batch of 2, right-padded) and
    a greedy generation equal our model's."""
    pairs = [["ROMEO:", " hello"], ["To be, or", " not to be"], ["a", "b"]]
    run = subprocess.run([sys.executable, "-c", LM_EVAL, str(hf_dir), json.dumps(pairs)],
                         capture_output=True, text=True, env={**os.environ, **OFFLINE},
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    _, model, _ = model_from_checkpoint(latest_checkpoint(run_dir))
    bytes_ = ByteTokenizer()
    assert result["max_length"] == 128
    for (context, continuation), (score, greedy) in zip(pairs, result["scores"], strict=True):
        tokens = torch.tensor([bytes_.encode(context + continuation)])
        start = len(bytes_.encode(context))
        with torch.no_grad():
            logp = torch.log_softmax(model(tokens[:, :-1]).double(), -1)[0, start - 1:]
        targets = tokens[0, start:]
        expected = logp.gather(-1, targets[:, None]).sum().item()
        assert score == pytest.approx(expected, rel=1e-4, abs=1e-4)
        assert greedy == bool((logp.argmax(-1) == targets).all())
    prompt = torch.tensor([bytes_.encode("JULIET:")])
    new = model.generate(prompt, 24, top_k=1)[0, prompt.shape[1]:].tolist()
    if 0 in new:  # the end-of-text id stops it
        new = new[:new.index(0)]
    assert result["text"] == [bytes_.decode(new).split("\n\n")[0]]


TASKS = {
    "nsa_ll.yaml": """task: nsa_ll
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list: [{{metric: acc}}]
""",
    "nsa_gen.yaml": """task: nsa_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
generation_kwargs: {{until: ["\\n\\n"], max_gen_toks: 16, do_sample: false}}
metric_list: [{{metric: exact_match}}]
""",
}


@needs_lm_eval
def test_lm_eval_command_line_evaluates_the_directory(hf_dir, tmp_path):
    """'python -m nsa.hf.harness' (lm_eval's command line after 'import nsa.hf') runs a
    log-likelihood and a generation task from local files, offline."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"context": c, "continuation": x}) + "\n"
                            for c, x in [("ROMEO:", " hello"), ("To be, or", " not to be")]))
    for name, text in TASKS.items():
        (tmp_path / name).write_text(text.format(data=data))
    env = {**os.environ, **OFFLINE, "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    run = subprocess.run(
        [sys.executable, "-m", "nsa.hf.harness", "--model", "hf", "--model_args",
         f"pretrained={hf_dir},dtype=float32", "--device", "cpu", "--batch_size", "1",
         "--include_path", str(tmp_path), "--tasks", "nsa_ll,nsa_gen",
         "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (results,) = (tmp_path / "out").rglob("results_*.json")
    scores = json.loads(results.read_text())["results"]
    assert set(scores) == {"nsa_ll", "nsa_gen"}
    assert "acc,none" in scores["nsa_ll"] and "exact_match,none" in scores["nsa_gen"]
