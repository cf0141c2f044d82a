"""Built-in tiny models: complete Hugging Face folders that transformers loads, deterministic, with a chat template."""

import json
import os
import time

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from infer.errors import ModelLoadError
from infer.models import tiny
from infer.models.resolve import resolve_model
from infer.models.tiny import BUILTIN_MODELS, builtin_names, ensure_builtin

TINY = {"tiny-llama": "LlamaForCausalLM", "tiny-qwen2": "Qwen2ForCausalLM", "tiny-mistral": "MistralForCausalLM",
        "tiny-qwen3": "Qwen3ForCausalLM", "tiny-llama3": "LlamaForCausalLM"}
PROMPTS = ["The weather today is", "To cook rice, rinse it", "A computer keeps its files", "Trains leave the"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """Every built-in model of this module is built once, into a cache that $INFER_CACHE points at."""
    root = tmp_path_factory.mktemp("tiny-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INFER_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def loaded(cache):
    out = {}
    for name in TINY:
        path = ensure_builtin(name)
        out[name] = (path, AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval())
    return out


def test_names_and_specs():
    assert builtin_names() == list(BUILTIN_MODELS)
    assert set(TINY) | {"llama-100m"} <= set(builtin_names())
    for name in TINY:
        cfg = BUILTIN_MODELS[name].config
        assert 64 <= cfg["hidden_size"] <= 128 and 2 <= cfg["num_hidden_layers"] <= 4
        assert cfg["num_key_value_heads"] < cfg["num_attention_heads"] and cfg["max_position_embeddings"] == 4096


def test_cache_location_follows_infer_cache(cache):
    path = ensure_builtin("tiny-llama")
    assert path.parent == cache / "models" and path.name.startswith("tiny-llama")
    assert resolve_model("tiny-llama") == path


@pytest.mark.parametrize("name", TINY)
def test_folder_loads_with_transformers(loaded, name):
    path, tok, model = loaded[name]
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in path.iterdir()}
    assert type(model).__name__ == TINY[name] and model.config.architectures == [TINY[name]]
    assert model.dtype == torch.float32 and len(tok) == model.config.vocab_size
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    gen = json.loads((path / "generation_config.json").read_text())
    assert tok.eos_token_id == eos == model.config.eos_token_id == gen["eos_token_id"]
    assert tok.pad_token == "<|endoftext|>" and gen["pad_token_id"] == tok.pad_token_id
    with safe_open(path / "model.safetensors", "pt") as f:
        assert all(f.get_slice(k).get_dtype() == "F32" for k in f.keys())


def test_architecture_specifics(loaded):
    attn = lambda name: loaded[name][2].model.layers[0].self_attn  # noqa: E731
    assert attn("tiny-qwen2").q_proj.bias is not None and attn("tiny-llama").q_proj.bias is None
    assert hasattr(attn("tiny-qwen3"), "q_norm") and hasattr(attn("tiny-qwen3"), "k_norm")
    assert attn("tiny-qwen3").q_proj.out_features == 4 * 32  # head_dim differs from hidden / heads
    cfg = loaded["tiny-llama3"][2].config
    assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.tie_word_embeddings
    m = loaded["tiny-llama3"][2]
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    assert not loaded["tiny-llama"][2].config.tie_word_embeddings


def test_chat_template(loaded):
    tok = loaded["tiny-qwen2"][1]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs, tokenize=False) == text[:-len("<|im_start|>assistant\n")]
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3 and ids.count(tok.eos_token_id) == 2
    assert tok.decode(ids) == text


def test_tokenizer_round_trips_text(loaded):
    tok = loaded["tiny-llama"][1]
    for text in ["Hello, world! 42 times.", "naïve café — ünïcödé ✓", "  two  spaces\n\nand tabs\t."]:
        ids = tok(text, add_special_tokens=False).input_ids
        assert tok.decode(ids) == text
    assert len(tok("The weather today is mild", add_special_tokens=False).input_ids) < 12  # merges were learnt


@pytest.mark.parametrize("name", TINY)
def test_greedy_generation_depends_on_the_prompt(loaded, name):
    _, tok, model = loaded[name]
    outs = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        outs.append(gen[0, ids.shape[1]:].tolist())
    assert len({tuple(o) for o in outs}) == len(PROMPTS)
    assert all(len(set(o)) >= 3 for o in outs), outs  # not one token repeated


def test_two_builds_are_byte_identical(tmp_path):
    tiny._tokenizer_json.cache_clear()  # retrain the tokenizer too
    a = ensure_builtin("tiny-qwen3", tmp_path / "a")
    tiny._tokenizer_json.cache_clear()
    b = ensure_builtin("tiny-qwen3", tmp_path / "b")
    for f in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    other = ensure_builtin("tiny-llama", tmp_path / "a")
    assert (other / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()  # one tokenizer
    assert (other / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()


def test_building_leaves_the_callers_random_state_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    ensure_builtin("tiny-mistral", tmp_path)
    assert torch.equal(torch.rand(4), expected)


def test_built_once_then_reused(tmp_path, monkeypatch):
    path = ensure_builtin("tiny-llama", tmp_path)
    monkeypatch.setattr(tiny, "_build", lambda *a: pytest.fail("rebuilt a cached model"))
    assert ensure_builtin("tiny-llama", tmp_path) == path


def test_a_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    stale = tmp_path / ".tiny-llama-killed"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))

    def broken(spec, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "_build", broken)
    with pytest.raises(KeyboardInterrupt):
        ensure_builtin("tiny-llama", tmp_path)
    assert list(tmp_path.iterdir()) == []  # neither the half build nor the stale one from a killed run
    monkeypatch.undo()
    assert (ensure_builtin("tiny-llama", tmp_path) / "model.safetensors").is_file()


def test_unknown_names_and_bad_paths(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        ensure_builtin("tiny-gpt5")
    assert "tiny-gpt5" in str(e.value) and all(n in str(e.value) for n in builtin_names())
    with pytest.raises(ModelLoadError) as e:
        resolve_model("meta-llama/Llama-2-7b-hf")
    assert "neither a local model folder nor a built-in model" in e.value.message and "tiny-qwen2" in e.value.message
    assert "nothing is downloaded" in e.value.hint
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a model folder"):
        resolve_model(tmp_path / "weights.bin")
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_llama_100m_config_size():
    spec = BUILTIN_MODELS["llama-100m"]
    cfg = AutoConfig.for_model(spec.arch, vocab_size=spec.vocab_size, **spec.config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert cfg.hidden_size == 768 and cfg.num_hidden_layers == 12 and cfg.vocab_size == 32000
    assert 100e6 <= n <= 140e6, n


@pytest.mark.slow
def test_llama_100m_builds(cache):
    path = ensure_builtin("llama-100m")
    tok = AutoTokenizer.from_pretrained(path)
    cfg = AutoConfig.from_pretrained(path)
    assert len(tok) <= cfg.vocab_size == 32000 and cfg.eos_token_id == tok.eos_token_id
    with safe_open(path / "model.safetensors", "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [32000, 768]
