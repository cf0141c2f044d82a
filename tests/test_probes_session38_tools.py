"""Probes of the thirty-eighth session (tools: quantize, convert, lora-validate, warmup, bench)."""

from __future__ import annotations

import pytest
import torch
import typer
from typer.testing import CliRunner

from infer.cli.main import app
from infer.errors import LoRAError


def test_warmup_under_a_budget_the_weights_exceed_says_so_not_to_lower_the_batch():
    """tiny-llama's 1 MiB of weights under --memory-limit 512KiB: warmup said "Lower --max-num-batched-tokens (4,096)
    or --concurrency (2), whose activations take most of the budget", which no batch size can make fit (llama-100m
    under 800MB with 16,384 batched tokens said the same). It now names the weights, as an engine start does."""
    res = CliRunner().invoke(app, ["warmup", "tiny-llama", "--estimate", "--max-length", "256", "--concurrency", "2",
                                   "--memory-limit", "512KiB"])
    text = " ".join(res.output.split())
    assert res.exit_code == 1, res.output
    assert "The weights alone take 1.0 MiB of the budget of 0.5 MiB: raise --memory-limit, or run a smaller or " \
           "quantized model" in text
    assert "--max-num-batched-tokens" not in text


def _convert(*args):
    from infer.cli.convert import convert
    app = typer.Typer()
    app.command()(convert)
    app.command("noop")(lambda: None)
    return CliRunner().invoke(app, ["convert", *map(str, args)])


@pytest.mark.parametrize("kind", ["dora", "modules_to_save", "bias_all", "embedding"])
def test_convert_merges_the_adapters_only_serving_refuses_as_peft_merges_them(tmp_path, kind):
    """DoRA, modules_to_save, trained base biases and embedding targets cannot be served per request, and
    `lora-validate` says "merge the DoRA adapter into the base model" — but `infer convert --merge-lora` refused them
    too, with that same hint: the command that merges sent the user back to merging. peft's merge_and_unload folds
    each in; convert now writes the model peft merges (tensor for tensor)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from infer.models.resolve import resolve_model
    src = resolve_model("tiny-qwen2")  # q/k/v have biases
    kw = {"dora": dict(use_dora=True), "modules_to_save": dict(modules_to_save=["lm_head"]),
          "bias_all": dict(bias="all"), "embedding": dict(target_modules=["q_proj", "embed_tokens"])}[kind]
    cfg = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"], **kw})
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:  # the adapter's weights, the trained head and biases: away from their init
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(tmp_path / "ad")
    r = _convert(src, "-o", tmp_path / "merged", "--merge-lora", tmp_path / "ad")
    assert r.exit_code == 0, (r.output, r.exception)
    fresh = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    want = PeftModel.from_pretrained(fresh, tmp_path / "ad").merge_and_unload().state_dict()
    got = load_file(tmp_path / "merged" / "model.safetensors")
    plain = load_file(src / "model.safetensors")
    assert set(got) == set(plain)
    assert any(not torch.equal(got[k], plain[k]) for k in plain)
    for k in plain:
        torch.testing.assert_close(got[k], want[k], atol=0, rtol=0)


def test_convert_still_refuses_a_lora_bias_the_base_has_no_bias_for(tmp_path):
    """peft cannot merge lora_bias=True into a layer without a bias (a RuntimeError after loading the model):
    convert keeps refusing it first, in one line."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from infer.models.resolve import resolve_model
    src = resolve_model("tiny-llama")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], lora_bias=True)
    get_peft_model(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), cfg).save_pretrained(tmp_path / "a")
    r = _convert(src, "-o", tmp_path / "merged", "--merge-lora", tmp_path / "a")
    assert isinstance(r.exception, LoRAError) and "trains a LoRA bias" in str(r.exception), (r.output, r.exception)
    assert not (tmp_path / "merged").exists()


def _tied_copy(tmp_path, head: str):
    """tiny-llama with tie_word_embeddings true and lm_head.weight stored: the embeddings' copy, or its own head."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from infer.models.resolve import resolve_model
    src, d = resolve_model("tiny-llama"), tmp_path / f"tied-{head}"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    tensors = load_file(d / "model.safetensors")
    if head == "same":
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return d


def test_quantize_refuses_a_tied_config_whose_checkpoint_stores_another_head(tmp_path, monkeypatch):
    """config.json says tie_word_embeddings but the weights hold their own lm_head.weight: transformers and `infer run`
    answer through the stored head (with a warning), GPTQModel tied it and wrote no head, so the quantized model
    answered through the embeddings: another model, silently. It is refused before calibrating, naming the fix."""
    from infer.errors import ConfigError
    from infer.models.loader import check_weights
    from infer.quant import quantize as q

    def started():
        raise RuntimeError("calibration started")
    monkeypatch.setattr(q, "require_gptqmodel", started)
    opts = q.QuantizeOptions(group_size=32)
    with pytest.raises(ConfigError, match="stores a different lm_head.weight") as e:
        q.quantize_model(_tied_copy(tmp_path, "own"), tmp_path / "q", opts, check_weights=check_weights)
    assert '"tie_word_embeddings": false' in e.value.hint and not (tmp_path / "q").exists()
    with pytest.raises(RuntimeError, match="calibration started"):  # the same head as the embeddings: quantized
        q.quantize_model(_tied_copy(tmp_path, "same"), tmp_path / "q", opts, check_weights=check_weights)


STRICT_TEMPLATE = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                   "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                   "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


def test_a_calibration_chat_the_template_refuses_is_named_by_line_not_a_traceback(tmp_path):
    """Mistral's and Llama 2's templates raise on roles that do not alternate (or on a system turn): a calibration
    .jsonl holding such a chat ended `infer quantize` in jinja's traceback. It is now one error naming the line, as
    `infer bench` names a dataset line its template refuses."""
    import json

    from transformers import AutoTokenizer

    from infer.errors import ConfigError
    from infer.models.resolve import resolve_model
    from infer.quant.calibration import load_calibration
    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-llama"))
    tok.chat_template = STRICT_TEMPLATE
    path = tmp_path / "calib.jsonl"
    chats = [[{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi, how can I help?"}],
             [{"role": "user", "content": "hello"}, {"role": "user", "content": "again"}]]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    with pytest.raises(ConfigError, match=r"calib\.jsonl, line 2: the chat template cannot render these messages: "
                                          r"Conversation roles must alternate"):
        load_calibration(path, tok, 4, 16)


def test_adapter_slots_that_take_the_budget_are_named_by_warmup_and_an_engine_start():
    """200 adapter slots of rank 256 take 400 MiB of a 200 MiB budget: warmup said only "raise --memory-limit" and
    an engine start "raise --memory-limit", though no length or concurrency makes room and --max-loras or
    --max-lora-rank is what the user asked too much of. Both now name them, with the bytes the slots take."""
    from infer.engine.config import EngineConfig
    from infer.engine.setup import load_engine_parts
    from infer.errors import OutOfMemoryError
    res = CliRunner().invoke(app, ["warmup", "tiny-llama", "--estimate", "--max-length", "256", "--concurrency", "2",
                                   "--enable-lora", "--max-loras", "200", "--max-lora-rank", "256",
                                   "--memory-limit", "200MB"])
    text = " ".join(res.output.split())
    assert res.exit_code == 1 and "Lower --max-loras or --max-lora-rank, whose adapter slots take 400.0 MiB of the " \
        "budget of 200.0 MiB, or raise --memory-limit" in text, text
    # 94 slots (188 MiB) and the weights fit the budget (190.7 MiB), leaving no room for a sequence's KV cache: the
    # memory plan's error names the slots (more than 95 are refused before they are allocated, naming them too)
    with pytest.raises(OutOfMemoryError) as e:
        load_engine_parts(EngineConfig(model="tiny-llama", enable_lora=True, max_loras=94, max_lora_rank=256,
                                       memory_limit="200MB", max_model_len=256))
    assert str(e.value).startswith("a single sequence of 256 tokens does not fit"), str(e.value)
    assert "or lower --max-loras (94) or --max-lora-rank (256), whose adapter slots take 188.0 MiB, or raise " \
        "--memory-limit" in e.value.hint, e.value.hint


def test_adapter_slots_the_device_cannot_allocate_are_one_error_naming_the_flags(monkeypatch):
    """An engine start allocates the adapter slots before its memory plan sees them: --max-loras x --max-lora-rank
    beyond the device's memory ended in torch's allocator traceback (CUDA out of memory, or CPU's "can't allocate
    memory") inside LoRALayer. It is now one OutOfMemoryError naming both flags, and no layer keeps a slot."""
    from infer.errors import OutOfMemoryError
    from infer.lora import manager
    from infer.models.loader import load_model
    from infer.models.resolve import resolve_model
    model, _ = load_model(resolve_model("tiny-llama"), torch.float32, torch.device("cpu"))
    real, made = manager.LoRALayer, []

    def layer(*args):
        if made:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        made.append(real(*args))
        return made[-1]
    monkeypatch.setattr(manager, "LoRALayer", layer)
    with pytest.raises(OutOfMemoryError, match=r"--max-loras 64 x --max-lora-rank 64 .*CUDA out of memory") as e:
        manager.LoRAManager(model, max_loras=64, max_lora_rank=64)
    assert "lower --max-loras or --max-lora-rank" in e.value.hint
    assert made and all(m.lora is None for m in model.modules() if hasattr(m, "lora"))


def test_lora_validate_on_a_short_context_base_works_within_it_and_names_steps(tmp_path):
    """The numeric check sized its engine at 64 + --steps tokens whatever the base's context: on a base of 64
    positions every adapter's check died with "--max-model-len 72 is above the model's limit of 64 (use
    --max-model-len 64 or less)", an option lora-validate does not have. It now runs within the base's context, and
    --steps beyond it is refused naming --steps."""
    import json
    import shutil

    from lora_helpers import hf_float, save_adapter

    from infer.models.resolve import resolve_model
    base = tmp_path / "short"
    shutil.copytree(resolve_model("tiny-llama"), base)
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 64}))
    save_adapter(hf_float(base), tmp_path / "ad", seed=0, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    ok = CliRunner().invoke(app, ["lora-validate", str(base), f"a={tmp_path / 'ad'}", "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout.splitlines()[-1])["numeric"]["tokens_agree"] is True
    far = CliRunner().invoke(app, ["lora-validate", str(base), f"a={tmp_path / 'ad'}", "--steps", "100"])
    text = " ".join(far.output.split())
    assert far.exit_code == 2 and "the base model has 64" in text and "use --steps" in text, text


def _config_only(tmp_path, **config):
    import json
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                               **config}))
    return d


def test_quantize_checks_o_projs_input_against_the_group_size_before_calibrating(tmp_path):
    """head_dim set apart from hidden_size / heads (Qwen3 does): o_proj's input is heads x head_dim (96), which
    --group-size 64 does not divide though it divides hidden_size (64) and intermediate_size (128); quantize only
    checked the last two and wrote a checkpoint with a partial group."""
    from infer.errors import ConfigError
    from infer.quant.quantize import QuantizeOptions, quantize_model
    src = _config_only(tmp_path, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=24,
                       num_key_value_heads=4)
    with pytest.raises(ConfigError, match="does not divide") as e:
        quantize_model(src, tmp_path / "o", QuantizeOptions(group_size=64))
    assert "o_proj's input, num_attention_heads x head_dim (4 x 24) = 96" in str(e.value)
    assert "hidden_size" not in str(e.value) and not (tmp_path / "o").exists()


def test_quantize_refuses_widths_that_do_not_pack_naming_them_and_the_bits_that_would(tmp_path):
    """k_proj's and v_proj's outputs of 3 x 20 = 60 do not pack into int32 words of eight 4-bit values: GPTQModel
    wrote the checkpoint, transformers ran it, infer then refused it naming q_proj (whose 80 packs)."""
    from infer.errors import ConfigError
    from infer.quant.quantize import QuantizeOptions, quantize_model
    src = _config_only(tmp_path, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=20,
                       num_key_value_heads=3)
    with pytest.raises(ConfigError, match="does not pack") as e:
        quantize_model(src, tmp_path / "o", QuantizeOptions(group_size=-1))
    text = str(e.value)
    assert "k_proj's and v_proj's output, num_key_value_heads x head_dim (3 x 20) = 60" in text
    assert "q_proj" not in text.split("k_proj")[0] and "--bits 8" in text


def test_a_gptq_layer_that_does_not_pack_names_the_projection_that_does_not():
    from infer.errors import ModelLoadError
    from infer.models.layers import MergedLinear
    from infer.quant.config import GPTQConfig
    from infer.quant.gptq_linear import GPTQLinearMethod
    names = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    with pytest.raises(ModelLoadError) as e:
        MergedLinear(64, [80, 60, 60], names, False, GPTQLinearMethod(GPTQConfig()), torch.float32)
    assert str(e.value).startswith("model.layers.0.self_attn.k_proj (output 60), model.layers.0.self_attn.v_proj "
                                   "(output 60): the width does not pack into int32 words of 8 4-bit values")


def test_adapter_slots_beyond_the_budget_are_refused_before_they_are_allocated(monkeypatch):
    """--max-loras 100000 x --max-lora-rank 256 on tiny-llama is 195 GiB of slots: an engine start allocated them
    before its memory plan counted them, and on a CPU the process filled the machine's memory until it was killed.
    Now the start refuses them first, naming both flags, and allocates no slot."""
    from infer import LLM
    from infer.errors import OutOfMemoryError
    from infer.lora import manager
    built = []
    monkeypatch.setattr(manager, "LoRALayer", lambda *args: built.append(args))
    with pytest.raises(OutOfMemoryError, match=r"--max-loras 100000 x --max-lora-rank 256 on every layer\) take") as e:
        LLM("tiny-llama", enable_lora=True, max_loras=100000, max_lora_rank=256, memory_limit=2 ** 30)
    assert e.value.hint.startswith("lower --max-loras (100000) or --max-lora-rank (256), whose adapter slots take ")
    assert e.value.hint.endswith(" GiB, or raise --memory-limit") and not built
