"""`infer convert`: .bin / sharded -> safetensors with identical tensors, --dtype, --merge-lora against peft's own
merge, GPTQ checkpoints copied unchanged, and the errors a user can cause."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import typer
from safetensors.torch import load_file
from typer.testing import CliRunner

from infer.errors import ConfigError, LoRAError, ModelLoadError

runner = CliRunner()


def run_cli(*args):
    from infer.cli.convert import convert
    app = typer.Typer()
    app.command()(convert)
    app.command("noop")(lambda: None)
    return runner.invoke(app, ["convert", *map(str, args)])


def load_all(folder: Path) -> dict:
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def tiny():
    from infer.models.resolve import resolve_model
    return resolve_model("tiny-qwen2")


@pytest.fixture(scope="module")
def bin_model(tiny, tmp_path_factory):
    """The tiny model as an old-style pytorch_model.bin folder."""
    d = tmp_path_factory.mktemp("bin")
    for f in tiny.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy2(f, d / f.name)
    torch.save(load_file(tiny / "model.safetensors"), d / "pytorch_model.bin")
    return d


def test_bin_to_safetensors_identical(bin_model, tmp_path):
    r = run_cli(bin_model, "-o", tmp_path / "out")
    assert r.exit_code == 0, (r.output, r.exception)
    ref = torch.load(bin_model / "pytorch_model.bin", weights_only=True)
    got = load_all(tmp_path / "out")
    assert set(ref) <= set(got)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        assert (tmp_path / "out" / name).is_file()
    assert not list((tmp_path / "out").glob("*.bin"))


def test_sharded_roundtrip_and_loads(tiny, tmp_path):
    from transformers import AutoModelForCausalLM
    r = run_cli(tiny, "-o", tmp_path / "sh", "--max-shard-size", "100KB")
    assert r.exit_code == 0, (r.output, r.exception)
    assert len(list((tmp_path / "sh").glob("*.safetensors"))) > 1
    assert (tmp_path / "sh" / "model.safetensors.index.json").is_file()
    r = run_cli(tmp_path / "sh", "-o", tmp_path / "one")  # sharded -> one file again
    assert r.exit_code == 0 and (tmp_path / "one" / "model.safetensors").is_file()
    ref, got = load_file(tiny / "model.safetensors"), load_all(tmp_path / "one")
    assert all(torch.equal(got[k], v) for k, v in ref.items())
    a = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "sh", dtype=torch.float32)
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype(tiny, tmp_path, dtype):
    r = run_cli(tiny, "-o", tmp_path / dtype, "--dtype", dtype)
    assert r.exit_code == 0, (r.output, r.exception)
    ref, got = load_file(tiny / "model.safetensors"), load_all(tmp_path / dtype)
    for k, v in ref.items():
        assert got[k].dtype == getattr(torch, dtype) and torch.equal(got[k], v.to(got[k].dtype)), k
    assert json.loads((tmp_path / dtype / "config.json").read_text())["dtype"] == dtype


def test_merge_lora_equals_peft(tiny, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    get_peft_model(base, cfg).save_pretrained(tmp_path / "adapter")
    r = run_cli(tiny, "-o", tmp_path / "merged", "--merge-lora", tmp_path / "adapter")
    assert r.exit_code == 0, (r.output, r.exception)
    fresh = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    assert not any("lora" in k for k in load_all(tmp_path / "merged"))
    ids = torch.tensor([[7, 3, 99, 250, 31, 5, 64]])
    with torch.no_grad():
        want, got, base_logits = peft_model(ids).logits, merged(ids).logits, plain(ids).logits
    assert (want - base_logits).abs().max() > 1e-2  # the adapter changes the output
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.fixture
def fake_gptq(tmp_path):
    """tiny-llama's GPTQ checkpoint (round to nearest) as a .bin, with GPTQModel's quantize_config.json beside it:
    convert copies its tensors unchanged, after the checks `infer run` makes of them."""
    from test_probes_gptq_s19 import rtn_checkpoint
    d = rtn_checkpoint(tmp_path / "gptq")
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    torch.save(tensors, d / "pytorch_model.bin")
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    (d / "quantize_config.json").write_text(json.dumps(qc))
    return d, tensors


def test_gptq_copied_unchanged(fake_gptq, tmp_path):
    src, tensors = fake_gptq
    r = run_cli(src, "-o", tmp_path / "out")
    assert r.exit_code == 0, (r.output, r.exception)
    got = load_all(tmp_path / "out")
    assert set(got) == set(tensors) and all(torch.equal(got[k], v) and got[k].dtype == v.dtype
                                            for k, v in tensors.items())
    for name in ("config.json", "quantize_config.json", "tokenizer.json"):
        assert (tmp_path / "out" / name).read_text() == (src / name).read_text()


@pytest.mark.parametrize("tied", [True, False])
def test_gptq_bin_with_shared_tensors_converts(fake_gptq, tmp_path, tied):
    """torch.save of a tied model's state dict puts lm_head.weight on the embeddings' storage; safetensors refused
    it with a traceback. A tied head is left out (as transformers saves it); other shared tensors get a copy."""
    src, tensors = fake_gptq
    emb = torch.rand_like(tensors["model.embed_tokens.weight"])
    heads = ("model.embed_tokens.weight", "lm_head.weight")  # in a state dict's order: the embeddings first
    tensors = {**{k: v for k, v in tensors.items() if k not in heads}, **dict.fromkeys(heads, emb)}
    torch.save(tensors, src / "pytorch_model.bin")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": tied}))
    r = run_cli(src, "-o", tmp_path / "out")
    assert r.exit_code == 0, (r.output, r.exception)
    got = load_all(tmp_path / "out")
    assert set(got) == set(tensors) - ({"lm_head.weight"} if tied else set())
    assert all(torch.equal(got[k], tensors[k]) for k in got)


def test_gptq_refuses_dtype_and_lora(fake_gptq, tmp_path):
    src, _ = fake_gptq
    r = run_cli(src, "-o", tmp_path / "a", "--dtype", "float16")
    assert isinstance(r.exception, ConfigError) and "GPTQ" in str(r.exception)
    (tmp_path / "ad").mkdir()
    (tmp_path / "ad" / "adapter_config.json").write_text("{}")
    r = run_cli(src, "-o", tmp_path / "b", "--merge-lora", tmp_path / "ad")
    assert isinstance(r.exception, ConfigError) and "merge a LoRA adapter" in str(r.exception)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_bad_inputs(tiny, tmp_path):
    r = run_cli(tmp_path / "missing", "-o", tmp_path / "o")
    assert isinstance(r.exception, ModelLoadError)
    r = run_cli(tiny, "-o", tmp_path / "o", "--to", "gguf")
    assert isinstance(r.exception, ConfigError) and "--to" in str(r.exception)
    r = run_cli(tiny, "-o", tmp_path / "o", "--dtype", "int8")
    assert isinstance(r.exception, ConfigError) and "--dtype" in str(r.exception)
    r = run_cli(tiny, "-o", tmp_path / "o", "--merge-lora", tmp_path)
    assert isinstance(r.exception, LoRAError)
    r = run_cli(tiny, "-o", tiny, "--overwrite")
    assert isinstance(r.exception, ConfigError) and "input folder" in str(r.exception)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    r = run_cli(tiny, "-o", tmp_path / "full")
    assert isinstance(r.exception, ConfigError) and "--overwrite" in str(r.exception)
    assert not list(tmp_path.glob(".o.tmp-*")) and not (tmp_path / "o").exists()


@pytest.mark.parametrize("damage, words", [
    ("no-weights", "no weights"),
    ("truncated", "cannot read adapter_model.safetensors"),
    ("nan", "non-finite"),
    ("alpha-nan", "no valid 'lora_alpha'"),
    ("other-layers", "layer"),
])
def test_merge_refuses_adapters_that_cannot_run_on_the_base(tiny, tmp_path, damage, words):
    """The checks --lora makes, before peft sees the folder: peft takes a folder without weights for a Hub id and
    tries to download it, and merges NaN weights or another model's layers silently (writing a broken model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    ad = tmp_path / "ad"
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False)) \
        .save_pretrained(ad)
    weights = ad / "adapter_model.safetensors"
    tensors = load_file(weights)
    if damage == "no-weights":
        weights.unlink()
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "nan":
        key = next(k for k in tensors if "lora_B" in k)
        tensors[key][0, 0] = float("nan")
        from safetensors.torch import save_file
        save_file(tensors, weights)
    elif damage == "alpha-nan":
        cfg = json.loads((ad / "adapter_config.json").read_text())
        (ad / "adapter_config.json").write_text(json.dumps(cfg).replace('"lora_alpha": 8', '"lora_alpha": NaN'))
    else:
        from safetensors.torch import save_file
        save_file({k.replace("layers.0.", "layers.7."): v for k, v in tensors.items()}, weights)
    r = run_cli(tiny, "-o", tmp_path / "merged", "--merge-lora", ad)
    assert isinstance(r.exception, LoRAError), (r.output, r.exception)
    assert words in str(r.exception), str(r.exception)
    assert not (tmp_path / "merged").exists()


def test_overwrite_replaces_model(tiny, tmp_path):
    assert run_cli(tiny, "-o", tmp_path / "o", "--dtype", "float16").exit_code == 0
    r = run_cli(tiny, "-o", tmp_path / "o", "--overwrite")
    assert r.exit_code == 0, (r.output, r.exception)
    assert load_all(tmp_path / "o")["model.norm.weight"].dtype == torch.float32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def run_infer(*args):
    """The real `infer` app: errors go through handle_errors (one `error:` line and the InferError's exit code)."""
    from infer.cli.main import app
    return runner.invoke(app, [*map(str, args)])


@pytest.fixture(scope="module")
def tiny_llama():
    from infer.models.resolve import resolve_model
    return resolve_model("tiny-llama")


def _clean_error(r, exit_code: int, *words):
    assert r.exit_code == exit_code, (r.output, r.exception)
    assert isinstance(r.exception, SystemExit), r.exception  # no other exception (a traceback) reached the CLI
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.output
    for word in words:
        assert word in r.output, (word, r.output)


@pytest.mark.parametrize("content", ['{"model_type": "llama",', "[1, 2]", "\xff\xfe"])
@pytest.mark.parametrize("merge", [False, True])
def test_broken_config_json_is_one_error_exit_2(tiny_llama, tmp_path, content, merge):
    """A truncated config.json is refused as `infer run` refuses it: one `error:` line naming the file, exit 2,
    whether convert_model or the --merge-lora check reads it first."""
    src = tmp_path / "brk"
    shutil.copytree(tiny_llama, src)
    (src / "config.json").write_bytes(content.encode("latin-1"))
    extra = ["--merge-lora", tmp_path / "ad"] if merge else []
    if merge:
        (tmp_path / "ad").mkdir()
    r = run_infer("convert", src, "-o", tmp_path / "out", *extra)
    _clean_error(r, 2, f"cannot read {src / 'config.json'}", "not")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def _truncate(f: Path, size: int | None = None) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2 if size is None else size])


@pytest.mark.parametrize("kind", ["safetensors-header", "safetensors-half", "bin-half"])
def test_truncated_float_weight_file_is_one_error_exit_2(tiny_llama, tmp_path, kind):
    """A cut-short weight file (transformers raises safetensors' SafetensorError or torch's zip reader error, neither
    an OSError) is named with the words `infer run` uses, exit 2, and no half-written output is left."""
    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    weights = src / "model.safetensors"
    if kind.startswith("bin"):
        torch.save(load_file(weights), src / "pytorch_model.bin")
        weights.unlink()
        weights = src / "pytorch_model.bin"
    _truncate(weights, 100 if kind == "safetensors-header" else None)
    r = run_infer("convert", src, "-o", tmp_path / "out", "--dtype", "bfloat16")
    _clean_error(r, 2, f"cannot read weight file {weights}", "the file is corrupted or truncated")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_truncated_gptq_weight_file_is_one_error_exit_2(fake_gptq, tmp_path, fmt):
    src, tensors = fake_gptq
    weights = src / "pytorch_model.bin"
    if fmt == "safetensors":
        from safetensors.torch import save_file
        weights.unlink()
        weights = src / "model.safetensors"
        save_file(tensors, weights)
    _truncate(weights)
    r = run_infer("convert", src, "-o", tmp_path / "out")
    _clean_error(r, 2, f"cannot read weight file {weights}", "the file is corrupted or truncated")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.fixture
def umask():
    """Set the process umask for one test, restored after."""
    import os
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


def _modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder.parent)): p.stat().st_mode & 0o777 for p in [folder, *folder.rglob("*")]}


@pytest.mark.parametrize("mask", [0o022, 0o027])
@pytest.mark.parametrize("gptq", [False, True])
def test_output_modes_follow_the_umask(tiny_llama, fake_gptq, tmp_path, umask, mask, gptq):
    """The staging folder comes from mkdtemp (0700) and safetensors writes 0600 files: the finished model must have
    the modes a plain mkdir/open gives (0755/0644 under umask 022), so another account can serve it."""
    umask(mask)
    src = fake_gptq[0] if gptq else tiny_llama
    r = run_cli(src, "-o", tmp_path / "out")
    assert r.exit_code == 0, (r.output, r.exception)
    modes = _modes(tmp_path / "out")
    assert modes.pop("out") == 0o777 & ~mask
    assert "out/model.safetensors" in modes and "out/config.json" in modes
    assert modes == {name: 0o666 & ~mask for name in modes}


def test_staged_output_modes_follow_the_umask(tmp_path, umask):
    """`infer quantize` stages through the same staged_output: subfolders and files written 0600 are fixed too."""
    import os
    from infer.quant.convert import staged_output
    umask(0o022)
    with staged_output(tmp_path / "q", overwrite=False) as tmp:
        (tmp / "config.json").write_text("{}")
        (tmp / "sub").mkdir(mode=0o700)
        fd = os.open(tmp / "sub" / "model.safetensors", os.O_CREAT | os.O_WRONLY, 0o600)
        os.close(fd)
        os.symlink("config.json", tmp / "link.json")
    modes = _modes(tmp_path / "q")
    assert modes == {"q": 0o755, "q/sub": 0o755, "q/config.json": 0o644, "q/link.json": 0o644,
                     "q/sub/model.safetensors": 0o644}
    assert (tmp_path / "q" / "link.json").is_symlink()


def test_merge_lora_missing_folder_names_the_merge_lora_flag(tiny_llama, tmp_path):
    """load_adapter words its errors for `--lora NAME=PATH` (run, serve): convert has --merge-lora PATH instead."""
    r = run_infer("convert", tiny_llama, "-o", tmp_path / "out", "--merge-lora", tmp_path / "nowhere")
    _clean_error(r, 2, f"--merge-lora {tmp_path / 'nowhere'}: folder not found", "hint: pass --merge-lora PATH")
    assert "--lora NAME=PATH" not in r.output and "LoRA adapter '--merge-lora'" not in r.output


def test_gptq_with_a_missing_shard_is_refused_as_run_refuses_it(fake_gptq, tmp_path):
    """Copying the shards that are there wrote an incomplete model (its index dropped) and exited 0."""
    src, _ = fake_gptq
    assert run_cli(src, "-o", tmp_path / "sh", "--max-shard-size", "2KB").exit_code == 0
    shards = sorted((tmp_path / "sh").glob("model-*.safetensors"))
    assert len(shards) >= 2
    shards[1].unlink()
    r = run_infer("convert", tmp_path / "sh", "-o", tmp_path / "out")
    _clean_error(r, 2, f"is missing weight shards ['{shards[1].name}']", "copy the whole model folder")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def _with_config(src: Path, dest: Path, **changes) -> Path:
    """A copy of the model folder `src` whose config.json has `changes` (a value of None removes the key)."""
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(changes)
    (dest / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return dest


@pytest.mark.parametrize("changes, words", [
    (dict(num_hidden_layers=3), "the checkpoint has weights for 2 layers, config.json implies 3"),
    (dict(num_hidden_layers=1), "config.json has no place for: model.layers.1.input_layernorm.weight (and 8 more)"),
    (dict(hidden_size=None), "lm_head.weight has shape (512, 64), config.json implies (512, 4096)"),
    (dict(vocab_size=522), "lm_head.weight has shape (512, 64), config.json implies (522, 64)"),
    # an architecture infer does not run: transformers' own loading report, which it only prints
    (dict(model_type="gpt2", architectures=None, n_embd=64, n_layer=2, n_head=4),
     "do not match config.json (GPT2LMHeadModel): no tensor transformer.h.0.attn.c_attn.bias"),
])
def test_float_weights_that_do_not_match_config_are_refused(tiny_llama, tmp_path, changes, words):
    """transformers filled missing weights at random and dropped extra layers (exit 0), or raised its
    ignore_mismatched_sizes RuntimeError: now `infer run`'s loader checks, in its words, exit 2."""
    src = _with_config(tiny_llama, tmp_path / "src", **changes)
    r = run_infer("convert", src, "-o", tmp_path / "out")
    _clean_error(r, 2, words)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def _scaled_adapter(base: Path, dest: Path, factor: float) -> Path:
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)) \
        .save_pretrained(dest)
    weights = dest / "adapter_model.safetensors"
    save_file({k: v * factor for k, v in load_file(weights).items()}, weights)
    return dest


def test_merge_that_overflows_is_refused_naming_tensor_and_adapter(tiny_llama, tmp_path):
    """Finite adapter weights whose merge overflows the base's float16 (x1e3: products far past 65,504, well inside
    float32, so the adapter itself loads): 4 merged tensors were written with inf/NaN. Weights x1e30, whose product
    overflows float32 itself, are refused when the adapter is read, before any merge."""
    base = tmp_path / "f16"
    assert run_infer("convert", tiny_llama, "-o", base, "--dtype", "float16").exit_code == 0
    ad = _scaled_adapter(tiny_llama, tmp_path / "ad", 1e3)
    r = run_infer("convert", base, "-o", tmp_path / "out", "--merge-lora", ad)
    _clean_error(r, 2, f"merging the adapter {ad} gives non-finite weights (inf or NaN): "
                       "model.layers.0.self_attn.q_proj.weight (and 3 more)")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    huge = _scaled_adapter(tiny_llama, tmp_path / "huge", 1e30)
    r = run_infer("convert", tiny_llama, "-o", tmp_path / "out", "--merge-lora", huge)
    _clean_error(r, 2, "lora_B @ lora_A x scaling 2 overflows float32")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value, dtype, words", [
    (float("nan"), None, "has non-finite weights (inf or NaN): model.layers.0.mlp.up_proj.weight"),
    (1e6, "float16", "has non-finite weights (inf or NaN) once cast to float16: model.layers.0.mlp.up_proj.weight"),
])
def test_non_finite_weights_are_refused(tiny_llama, tmp_path, value, dtype, words):
    from safetensors.torch import save_file
    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"][3, 5] = value
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    r = run_infer("convert", src, "-o", tmp_path / "out", *(["--dtype", dtype] if dtype else []))
    _clean_error(r, 2, words)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("size, expected", [
    ("4GB", 4 * 10**9), ("1.5GB", 15 * 10**8), ("100KB", 100_000), ("4G", 4 * 10**9), ("2GiB", 2 * 2**30),
    ("512MiB", 512 * 2**20), ("100kib", 102_400), ("1e9", 10**9), ("123", 123), (2048, 2048),
])
def test_shard_sizes_parse_to_bytes(size, expected):
    """huggingface_hub reads only KB/MB/GB/TB (decimal) and GPTQModel reads GB as 2**30: both now get bytes."""
    from infer.quant.convert import parse_shard_size
    assert parse_shard_size(size) == expected


@pytest.mark.parametrize("size", ["2XB", "GB", "0", "-1", "1iB", "4 GB GB"])
def test_bad_shard_size_is_refused_before_any_work(tiny_llama, tmp_path, size):
    r = run_infer("convert", tmp_path / "no-such-model", "-o", tmp_path / "out", "--max-shard-size", size)
    _clean_error(r, 2, f"--max-shard-size {size!r}")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("size", ["2GiB", "100KiB", "1e9", "4G"])
def test_binary_and_plain_shard_sizes_convert(tiny_llama, tmp_path, size):
    """`2GiB`, the form infer's own hint suggests, failed in huggingface_hub with "Unit 'IB' not supported"."""
    r = run_infer("convert", tiny_llama, "-o", tmp_path / "out", "--max-shard-size", size)
    assert r.exit_code == 0, (r.output, r.exception)
    sharded = size == "100KiB"
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file() == sharded
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1 if sharded else \
        (tmp_path / "out" / "model.safetensors").is_file()
    ref, got = load_file(tiny_llama / "model.safetensors"), load_all(tmp_path / "out")
    assert set(got) == set(ref) and all(torch.equal(got[k], v) for k, v in ref.items())
