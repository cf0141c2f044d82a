"""Shared helpers for tests: HF oracle generation on the same weights."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import textwrap
import time
from pathlib import Path

import pytest
import torch

# The start of a subprocess script (argv[1]: scripts/kernel-sass) whose Triton compiles for sm_90 with the compile
# side of a driver (`CompileOnlyDriver`) and cannot load a kernel; `compiled` lists each kernel function compiled.
COMPILE_ONLY_PREAMBLE = textwrap.dedent('''
    import importlib.machinery, json, sys, torch, triton, types
    import triton.runtime.jit as jit
    loader = importlib.machinery.SourceFileLoader("kernel_sass", sys.argv[1])
    kernel_sass = types.ModuleType("kernel_sass")
    kernel_sass.__file__ = sys.argv[1]
    loader.exec_module(kernel_sass)
    triton.runtime.driver.set_active(kernel_sass.CompileOnlyDriver(90))  # compiles for sm_90, cannot load
    compiled = []
    real = jit.JITFunction._do_compile
    def counted(self, key, *a, **k):
        compiled.append(self.fn.__name__)
        return real(self, key, *a, **k)
    jit.JITFunction._do_compile = counted
''')


# the same, and every launch only compiles (Triton's warmup): nothing is loaded, so steps run through without errors
COMPILE_ONLY_LAUNCHES = COMPILE_ONLY_PREAMBLE + textwrap.dedent('''
    launch = jit.JITFunction.run
    def compile_instead(self, *args, grid, warmup, **kwargs):
        return launch(self, *args, grid=grid, warmup=True, **kwargs)
    jit.JITFunction.run = compile_instead
''')


# COMPILE_ONLY_PREAMBLE, every launch only compiled, each kernel's shared memory kept in `shared` as "NAME sm_ARCH"
# (arch[0]: the target a script's loop sets with `triton.runtime.driver.set_active(Driver(arch[0]))`)
COMPILE_ONLY_SHARED = COMPILE_ONLY_PREAMBLE + textwrap.dedent('''
    shared, arch = {}, [0]
    launch = jit.JITFunction.run
    def record(self, *args, grid, warmup, **kwargs):
        kern = launch(self, *args, grid=grid, warmup=True, **kwargs)
        shared[f"{self.fn.__name__} sm_{arch[0]}"] = kern.metadata.shared
        return kern
    jit.JITFunction.run = record
    class Driver(kernel_sass.CompileOnlyDriver):  # (a device of its own a target: Triton caches kernels by device)
        def get_current_device(self):
            return self.target.arch
''')


@contextlib.contextmanager
def nan_filled_empty(module):
    """`module.torch.empty` hands out NaN-filled float tensors meanwhile (a row a kernel forgets to write fails the
    comparison)."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module.torch, "empty", poisoned)
        yield


def in_empty_hub_cache(tmp_path, monkeypatch) -> None:
    """The test runs in tmp_path with an empty Hugging Face cache (HF_HOME there, no HF_HUB_CACHE override): a hub id
    is then one nothing has downloaded."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)


def measured_warmup(args: list[str]) -> dict:
    """`infer warmup --json ARGS`'s report (activation_peak_bytes measured, activation_estimate_bytes the formula's),
    run in a fresh process: on CPU the measurement is the growth of the peak RSS, which memory an earlier test freed
    would hide."""
    import json
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "infer.cli", "warmup", "--json", *args], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def meta_hub_model(model_type: str, arch: str, config: dict):
    """(config, model, its SparseMoeBlocks) of a hub-shaped config.json (`config` for `model_type`, architecture
    `arch`), which the registry's checks accept, its model built on the meta device in bfloat16."""
    from transformers import AutoConfig

    from infer.models.moe import SparseMoeBlock
    from infer.models.registry import check_supported, model_class
    cfg = AutoConfig.for_model(model_type, **config)
    cfg.architectures = [arch]
    check_supported(cfg)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, torch.bfloat16)
    return cfg, model, [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def estimated_plan(model: str, *args: str) -> dict:
    """`infer warmup MODEL --estimate --json ARGS`'s plan, run in this process; the command must succeed."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    res = CliRunner().invoke(app, ["warmup", model, "--estimate", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    m = _auto_class(json.loads((Path(path) / "config.json").read_text())).from_pretrained(path, dtype=torch.float32)
    m.generation_config.eos_token_id = None  # never stop (nor suppress EOS): compare with ignore_eos
    m.eval()
    return m


def hf_greedy(path: str, prompt: list[int], n: int, **kw) -> list[int]:
    m = hf_model(str(path))
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def _auto_class(config: dict):
    """transformers' auto class of a config: a multimodal model's (text_config: Gemma 3's, Mistral 3's
    ...ForConditionalGeneration) or a causal LM's."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    return AutoModelForImageTextToText if "text_config" in config else AutoModelForCausalLM


def save_random_model(folder, model_type: str, arch: str, config: dict, seed: int = 0, perturb=None,
                      eager: bool = True):
    """A random model of `model_type` (transformers' `arch`, float32, initializer_range 0.15, no BOS) from `config`,
    saved to `folder` with the tiny-llama tokenizer; returns transformers' model of it (eager attention unless
    `eager` is False; EOS off: it never stops). `perturb(name, p)`, called on every parameter under the same seed,
    moves weights the random init leaves constant (norms, biases) so that a bug in them changes the tokens. A
    multimodal model's (`config` with a text_config) text settings are its text_config's."""
    import shutil
    from transformers import AutoConfig
    from infer.models.tiny import ensure_builtin
    if "text_config" in config:
        config = {**config, "text_config": {"initializer_range": 0.15, "bos_token_id": None, **config["text_config"]}}
    cfg = AutoConfig.for_model(model_type, initializer_range=0.15, bos_token_id=None, **config)
    cfg.architectures = [arch]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _auto_class(config).from_config(cfg, dtype=torch.float32,
                                                 **({"attn_implementation": "eager"} if eager else {})).eval()
        if perturb is not None:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    perturb(name, p)
    model.save_pretrained(folder, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_builtin("tiny-llama") / f, Path(folder) / f)
    model.generation_config.eos_token_id = None
    return model


def build_score_head_model(src_name: str, folder, auto_class: str, num_labels: int, seed: int, labels: dict,
                           bias: bool = False, **config):
    """A transformers `auto_class` (AutoModelForSequenceClassification, ...ForTokenClassification) folder from the
    built-in tiny model `src_name`: its decoder and a random score head drawn from N(0, 1) after torch.manual_seed(seed)
    (its bias too where `bias`), `labels` its id2label where num_labels is 3, `config` set on its config; returns
    (folder, transformers' model in float32)."""
    import shutil

    import transformers

    from infer.models.tiny import ensure_builtin
    src = ensure_builtin(src_name)
    shutil.copytree(src, folder)
    torch.manual_seed(seed)
    kw = {"id2label": labels} if num_labels == 3 else {}
    hf = getattr(transformers, auto_class).from_pretrained(src, num_labels=num_labels, dtype=torch.float32, **kw)
    with torch.no_grad():
        hf.score.weight.normal_(0, 1.0)
        if bias:
            hf.score.bias.normal_(0, 1.0)
    for key, value in config.items():
        setattr(hf.config, key, value)
    hf.save_pretrained(folder)
    return folder, hf.eval()


def norms_drawn(mean: float):
    """A save_random_model perturb: every norm weight drawn from N(mean, 0.3) (Gemma's 1 + w norms: mean 0)."""
    def perturb(name, p):
        if "norm" in name:
            p.normal_(mean, 0.3)
    return perturb


def norms_and_biases_shifted(name, p):
    """A save_random_model perturb: norm weights and biases moved by N(0, 0.3)."""
    if name.endswith(".bias") or "norm" in name:
        p.add_(torch.randn_like(p) * 0.3)


def norms_shifted_biases_drawn(name, p):
    """A save_random_model perturb: norm weights moved by N(0, 0.3), biases drawn from N(0, 0.5) (a bug in them would
    go unseen at their init)."""
    if "norm" in name:
        p.add_(torch.randn_like(p) * 0.3)
    elif name.endswith("bias"):
        p.normal_(0.0, 0.5)


def correction_bias_drawn(hf, folder, seed: int, std: float, buffers: bool):
    """`hf` with each router's e_score_correction_bias (zeros at init; a buffer where `buffers`, else a parameter)
    drawn from N(0, std) (a generator of `seed`), saved again to `folder`; returns hf."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in (hf.named_buffers() if buffers else hf.named_parameters()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * std)
    hf.save_pretrained(folder)
    return hf


def estimate_refusal(folder, model_type: str, arch: str, **config) -> str:
    """transformers' `model_type` config of `config` (architectures [arch]) saved alone in `folder`: `infer warmup
    --estimate` refuses it; returns its output, white space folded."""
    from transformers import AutoConfig
    from typer.testing import CliRunner

    from infer.cli.main import app
    cfg = AutoConfig.for_model(model_type, **config)
    cfg.architectures = [arch]
    cfg.save_pretrained(folder)
    res = CliRunner().invoke(app, ["warmup", str(folder), "--estimate"], env={"COLUMNS": "250"})
    assert res.exit_code != 0, res.output
    return " ".join(res.output.split())


def hub_shaped_folder(folder, family: str, arch: str, config: dict, gptq_group: int = 0) -> int:
    """A model folder of transformers' `family` model (architecture `arch`) of `config` whose safetensors shards have
    the hub's tensors' names, shapes and dtypes (bfloat16, the routers float32) and no values (sparse files: a header,
    then a hole of the data's size), the tiny-llama tokenizer; with `gptq_group`, a 4-bit GPTQ checkpoint's in
    GPTQModel's layout (every projection's qweight, qzeros, scales and g_idx in groups of that size, each expert's
    apart, the vision tower's float). A multimodal `arch` (...ForConditionalGeneration: Llama-4-Scout's) builds
    transformers' image-text model, its vision tower's tensors stored too. Returns the parameters' count."""
    import shutil
    import struct

    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from infer.models.tiny import ensure_builtin
    cfg = AutoConfig.for_model(family, **config)
    cfg.architectures = [arch]
    auto = AutoModelForImageTextToText if arch.endswith("ForConditionalGeneration") else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(cfg, dtype=torch.bfloat16)
    # (Llama 4 stacks its experts [E, H, 2I] and [E, I, H], x @ W; the others [E, 2I, H] and [E, H, I])
    stacked_in_out = getattr(cfg.get_text_config(), "model_type", None) == "llama4_text"
    if gptq_group:
        cfg.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": gptq_group, "desc_act": False,
                                   "sym": True}
    cfg.save_pretrained(folder)
    shards, count = [{}], 0  # (shards of up to 1 GiB: a reader maps one file at a time)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:  # (a tied head: the embeddings' alone stored)
            continue
        count += t.numel()
        vision = "vision_model." in name or "multi_modal_projector." in name  # (GPTQModel quantizes the text model)
        for key, dtype, shape in _stored_tensors(name, t, 0 if vision else gptq_group, stacked_in_out):
            size = math.prod(shape) * (2 if dtype in ("BF16", "F16") else 4)
            if shards[-1] and shards[-1]["end"] + size > 1 << 30:
                shards.append({})
            start = shards[-1].setdefault("end", 0)
            shards[-1][key] = {"dtype": dtype, "shape": shape, "data_offsets": [start, start + size]}
            shards[-1]["end"] = start + size
    index = {}
    for i, header in enumerate(shards):
        end = header.pop("end")
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        raw = json.dumps(header).encode()
        with open(folder / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + end)
        index.update(dict.fromkeys(header, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_builtin("tiny-llama") / name, folder / name)
    return count


def _stored_tensors(name: str, t: torch.Tensor, group: int,
                    stacked_in_out: bool = False) -> list[tuple[str, str, list[int]]]:
    """(name, safetensors dtype, shape) of what a checkpoint stores for parameter `name` of `t`: itself (bfloat16,
    float32 where the model keeps it so); with `group`, a projection's 4-bit GPTQ tensors in groups of that size and
    transformers 5's stacked experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]; with `stacked_in_out` Llama 4's
    [E, H, 2I] and [E, I, H]; Nemotron 3's up_proj [E, I, H] without gate) as each expert's projections."""
    if group and t.dim() == 3 and name.endswith(("experts.gate_up_proj", "experts.up_proj", "experts.down_proj")):
        stack, _, proj = name.rpartition(".")
        e, rows, cols = (t.shape[0], t.shape[2], t.shape[1]) if stacked_in_out else t.shape
        parts = [("gate_proj", rows // 2), ("up_proj", rows // 2)] if proj == "gate_up_proj" else [(proj, rows)]
        return [x for i in range(e) for p, n in parts
                for x in _stored_tensors(f"{stack}.{i}.{p}.weight", torch.empty(n, cols, device="meta"), group)]
    if group and t.dim() == 2 and name.endswith("proj.weight"):
        module, (out, k) = name.removesuffix(".weight"), t.shape
        groups = -(-k // group)  # (a last partial group where k is no multiple: GLM-4.5-Air's 10944 of 128)
        return [(f"{module}.qweight", "I32", [k // 8, out]), (f"{module}.qzeros", "I32", [groups, out // 8]),
                (f"{module}.scales", "F16", [groups, out]), (f"{module}.g_idx", "I32", [k])]
    return [(name, "F32" if t.dtype == torch.float32 else "BF16", list(t.shape))]


def family_small_config(num_hidden_layers: int) -> dict:
    """The small config a family test file builds its random models over (family_builder's `small`): 4 heads of 16
    (2 KV heads), an MLP of 128, the tiny-llama tokenizer's vocabulary of 512, untied heads; `num_hidden_layers`."""
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=num_hidden_layers, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, vocab_size=512, eos_token_id=2, pad_token_id=0,
                tie_word_embeddings=False)


def family_builder(small: dict, families: dict, perturb=norms_and_biases_shifted):
    """`build(folder, family, seed=0, **config)` for a test file's `families` ({family: (model_type, architecture,
    config)}) over its `small` config: a random model folder of `family` (float32; `perturb(name, parameter)` on each
    parameter, by default norm weights and biases moved off their constant init) with the tiny-llama tokenizer, config
    the three merged; returns transformers' model (eager attention)."""
    def build(folder, family: str, seed: int = 0, **config):
        model_type, arch, extra = families[family]
        return save_random_model(folder, model_type, arch, {**small, **extra, **config}, seed, perturb)
    return build


def check_served_completion_equals_transformers(base, served_name: str, hf) -> None:
    """`infer serve` of the model in `base` completes a random prompt of 20 tokens with transformers' (`hf`) 5 greedy
    tokens, decoded."""
    from transformers import AutoTokenizer
    prompt = random_prompts(512, (20,), seed=8)[0]
    assert served_completion_text(base, served_name, prompt, 5) == \
        AutoTokenizer.from_pretrained(base).decode(greedy_each(hf, [prompt], 5)[0])


def greedy_tokens(llm, prompts, n: int, **kw) -> list[list[int]]:
    """The LLM's n greedy tokens (ignore_eos) of each prompt, batched; `kw`: more of LLM.generate's arguments."""
    from infer import SamplingParams
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True), **kw)]


def greedy_each(hf, prompts, n: int) -> list[list[int]]:
    """transformers' greedy continuation of n tokens of each prompt alone."""
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


def check_equal_transformers(hf, prompts, outs, n: int, name) -> None:
    """`outs` (LLM.generate's of `prompts`, n tokens each, ignore_eos, logprobs asked) are transformers' greedy tokens
    (`hf` float32, each prompt alone) and each token's logprob is transformers' within 1e-4."""
    assert [o.token_ids for o in outs] == greedy_each(hf, prompts, n), name
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            logp = hf(torch.tensor([p + out.token_ids])).logits[0, len(p) - 1:-1].log_softmax(-1)
        for i, rec in enumerate(out.logprobs):
            assert abs(rec["logprob"] - float(logp[i, rec["token_id"]])) < 1e-4, (name, i)


def check_greedy_and_logprobs_equal_transformers(folder, hf, name, check_model) -> None:
    """The model in `folder` (blocks of 4), which `check_model(model)` checks first, generates 10 tokens of prompts of
    5, 13 and 30 tokens, batched: transformers' (`hf`) greedy tokens, the logprobs within 1e-4
    (check_equal_transformers)."""
    from infer import LLM, SamplingParams
    prompts = random_prompts(512, (5, 13, 30), seed=3)
    with LLM(str(folder), block_size=4) as llm:
        check_model(llm.engine.runner.model)
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=3))
    check_equal_transformers(hf, prompts, outs, 10, name)


def greedy_and_logprobs_test(configs: dict, build, check_model):
    """A family test file's test_greedy_tokens_and_logprobs_equal_transformers, parametrized by the names of `configs`
    ({name: (family, config)}): `build(folder, family, **config)`'s model, which `check_model(model, hf, family,
    config)` checks as infer loaded it (hf: transformers' model), equals transformers
    (check_greedy_and_logprobs_equal_transformers)."""
    @pytest.mark.parametrize("name", configs)
    def test_greedy_tokens_and_logprobs_equal_transformers(tmp_path, name):
        """Prompts of 5, 13 and 30 tokens and 10 generated, batched: transformers' tokens, the logprobs within 1e-4."""
        family, config = configs[name]
        hf = build(tmp_path, family, **config)
        check_greedy_and_logprobs_equal_transformers(tmp_path, hf, name,
                                                     lambda model: check_model(model, hf, family, config))
    return test_greedy_tokens_and_logprobs_equal_transformers


def check_stray_sliding_window(folder, hf, family: str) -> None:
    """The model in `folder` (transformers' `hf`), whose config.json has sliding_window 16 that its family's attention
    ignores (models.limits.WINDOW_IGNORED): a max_model_len past the window is refused naming it, the context is
    capped at the window, no layer slides, and within it the greedy tokens of prompts of 5 and 10 are
    transformers'."""
    import pytest

    from infer import LLM
    from infer.errors import ConfigError
    with pytest.raises(ConfigError, match=rf"limit of 16 \(its sliding_window: a {family} model's attention is full"):
        LLM(str(folder), block_size=4, max_model_len=64)
    prompts = random_prompts(512, (5, 10), seed=3)
    with LLM(str(folder), block_size=4) as llm:
        assert llm.engine.max_model_len == 16
        assert [layer.self_attn.window for layer in llm.engine.runner.model.layers] == [0] * len(hf.model.layers)
        assert greedy_tokens(llm, prompts, 6) == greedy_each(hf, prompts, 6)


def check_chunked_prefill_and_prefix_caching(folder, hf) -> None:
    """The model in `folder` (blocks of 4) gives transformers' (`hf`) greedy tokens (6) of prompts of 30 and 41 tokens
    and of one sharing the second's first 32, in steps of 12 tokens (prompts cut into chunks), and with prefix
    caching, the third prompt run after the others (some of its blocks found cached)."""
    from infer import LLM, SamplingParams

    def generate(llm, prompts):
        return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))]
    prompts = random_prompts(512, (30, 41), seed=5)
    prompts.append(prompts[1][:32] + [7, 8, 9])
    want = greedy_each(hf, prompts, 6)
    with LLM(str(folder), block_size=4, max_num_batched_tokens=12, max_num_seqs=2,
             enable_prefix_caching=False) as llm:
        assert generate(llm, prompts) == want
    with LLM(str(folder), block_size=4, enable_prefix_caching=True) as llm:
        assert generate(llm, prompts[:2]) == want[:2]
        assert generate(llm, prompts[2:]) == want[2:]
        assert llm.engine.stats()["prefix_cache_hits"] > 0


def check_builtin_runs_and_warmup_sizes_it(name: str, arch: str, nope: bool, lengths=(6, 40)) -> None:
    """The built-in model `name` (architecture `arch`) equals transformers on prompts of `lengths` tokens and writes
    varied tokens; `infer warmup --estimate` counts its weights as the loaded engine holds them (a NoPE table with its
    rope table where `nope`: models.llama._NoPE)."""
    import json

    from typer.testing import CliRunner

    from infer import LLM, SamplingParams
    from infer.cli.main import app
    from infer.memory.sizes import weights_bytes
    from infer.models.tiny import ensure_builtin
    path = ensure_builtin(name)
    assert json.loads((path / "config.json").read_text())["architectures"] == [arch]
    res = CliRunner().invoke(app, ["warmup", name, "--estimate", "--json", "--max-length", "256"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout.strip().splitlines()[-1])
    prompts = random_prompts(512, lengths, seed=1)
    with LLM(name, max_model_len=256) as llm:
        model = llm.engine.runner.model
        assert (getattr(model, "nope_cos_sin", None) is not None) == nope
        assert plan["weights_bytes"] == weights_bytes(model)
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))]
    assert got == greedy_each(hf_model(str(path)), prompts, 6)
    assert all(len(set(tokens)) > 2 for tokens in got)


def check_run_and_bench_builtin(tmp_path, name: str) -> None:
    """`infer run` of the built-in model `name` writes transformers' greedy tokens of a token prompt; `infer bench`
    completes its requests."""
    import json

    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.models.tiny import ensure_builtin
    prompt = random_prompts(512, (9,), seed=2)[0]
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "prompt_token_ids": prompt, "max_new_tokens": 6,
                                                   "ignore_eos": True}) + "\n")
    res = CliRunner().invoke(app, ["run", name, str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "-q"])
    assert res.exit_code == 0, res.output
    [record] = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert record["token_ids"] == greedy_each(hf_model(str(ensure_builtin(name))), [prompt], 6)[0]
    res = CliRunner().invoke(app, ["bench", name, "--out", str(tmp_path / "b"), "-c", "2", "--num-prompts", "2",
                                   "--input-len", "8", "--output-len", "6", "-q"])
    assert res.exit_code == 0, res.output
    [report] = json.loads((tmp_path / "b" / "results.json").read_text())
    assert report["completed"] == 2


def builtin_model_tests(archs: dict, nope=()):
    """A family test file's tests of its built-in tiny models (`archs`: {name: architecture}; `nope`: the names with a
    NoPE table), parametrized by name: `test_builtin_tiny_model_runs_and_warmup_sizes_it,
    test_infer_run_and_bench_on_the_builtin_model = builtin_model_tests(...)` (pytest collects them by those names)."""
    @pytest.mark.parametrize("name", archs)
    def test_builtin_tiny_model_runs_and_warmup_sizes_it(name):
        check_builtin_runs_and_warmup_sizes_it(name, archs[name], name in nope)

    @pytest.mark.parametrize("name", archs)
    def test_infer_run_and_bench_on_the_builtin_model(tmp_path, name):
        check_run_and_bench_builtin(tmp_path, name)
    return test_builtin_tiny_model_runs_and_warmup_sizes_it, test_infer_run_and_bench_on_the_builtin_model


def check_stream_adds_up(req, text: str) -> None:
    """Streamed `text` of a reply (reasoning parser `req`), at every length: each part (reasoning, content) only
    grows, and the last ones are the whole reply's."""
    from infer.serve.reasoning import parts, split
    sent = ("", "")
    for k in range(len(text) + 1):
        now = parts(req, text[:k], finished=k == len(text))
        assert now[0].startswith(sent[0]) and now[1].startswith(sent[1]), (text[:k], sent, now)
        sent = now
    whole = split(req, text)
    assert sent == (whole[0] or "", whole[1] or "")


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def interpreted_module(name: str):
    """Yields module `name` with its Triton kernels interpreted on CPU when there is no GPU (TRITON_INTERPRET is read
    when kernels are decorated and when they are launched, so it stays set until the generator resumes)."""
    import importlib
    import os
    if torch.cuda.is_available():
        yield importlib.import_module(name)
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield importlib.reload(importlib.import_module(name))
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old


@pytest.fixture(scope="module")
def fused():
    """infer.kernels.fused interpreted (interpreted_module), for the test files that import this fixture."""
    yield from interpreted_module("infer.kernels.fused")


@pytest.fixture(scope="module")
def gemm(fused):
    """infer.kernels.gptq_gemm interpreted (after fused), for the test files that import this fixture."""
    yield from interpreted_module("infer.kernels.gptq_gemm")


def recorded_launch_arg(gemm, monkeypatch, index: int, name: str) -> list:
    """The argument `name` (at position `index`; 0 where the launch leaves it to its default) of every fused int4
    launch (`gemm`: an infer.kernels.gptq_gemm module, its _launch) from now on."""
    seen = []
    launch = gemm._launch
    monkeypatch.setattr(gemm, "_launch", lambda *a, **kw: (seen.append(a[index] if len(a) > index else kw.get(name, 0)),
                                                           launch(*a, **kw))[1])
    return seen


def fail_steps_of(monkeypatch, request_id: str) -> None:
    """Every engine step (ModelRunner.run) whose batch holds `request_id` raises, as a kernel failure would."""
    from infer.engine.model_runner import ModelRunner
    real = ModelRunner.run

    def run(self, batch):
        if any(s.request_id == request_id for s in batch.seqs):
            raise RuntimeError("simulated kernel failure")
        return real(self, batch)
    monkeypatch.setattr(ModelRunner, "run", run)


def run_compile_only(script: str, timeout: int) -> dict:
    """Run a COMPILE_ONLY_PREAMBLE script (compiled kernels, not the interpreter) and read the JSON object it
    prints last."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    res = subprocess.run([sys.executable, "-c", script, str(root / "scripts" / "kernel-sass")], capture_output=True,
                         text=True, timeout=timeout, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def serve_process(*args: str, env: dict | None = None):
    """`infer serve tiny-llama --port 0 ARGS` as a subprocess: yields (process, base URL, the start line's adapters
    text) once it listens; killed on leaving if it still runs."""
    import os
    import re
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "infer.cli", "serve", "tiny-llama", "--port", "0", *args],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        started = None
        for line in proc.stderr:  # bounded: the process exits (and the loop ends) if it fails to start
            started = re.search(r"on (http://127\.0\.0\.1:\d+)  adapters: (.*?)(?:  (?:sleep mode|pause): .*)?$", line)
            if started:
                break
        assert started, "the server did not start"
        yield proc, started.group(1), started.group(2)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def check_env_choice(monkeypatch, module, attr: str, read, var: str, values, bad: str, choices) -> None:
    """With module.<attr> unset (None), `read()` follows the environment's `var`: each (setting or None for
    unset, expected result) of `values`; `bad` is a ConfigError naming the variable, whose hint names `choices`."""
    from infer.errors import ConfigError
    monkeypatch.delenv(var, raising=False)
    for value, want in values:
        monkeypatch.setattr(module, attr, None)
        if value is not None:
            monkeypatch.setenv(var, value)
        assert read() is want, (var, value)
    monkeypatch.setattr(module, attr, None)
    monkeypatch.setenv(var, bad)
    with pytest.raises(ConfigError, match=var) as e:
        read()
    assert all(c in e.value.hint for c in choices), e.value.hint



class ModelsHandler:
    """Mixin of the tests' fake OpenAI servers (http.server handlers): GET answers /v1/models with one model "m",
    and nothing is logged."""

    def log_message(self, *a):  # keep pytest output clean
        pass

    def do_GET(self):
        import json
        payload = json.dumps({"object": "list", "data": [{"id": "m"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


CHATML_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# A Qwen-style template that renders the tools in a system turn (the built-in model's template ignores them).
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
                  "<|im_end|>\n{% endif %}" + CHATML_TEMPLATE)


def tiny_llama_with_template(path, template: str):
    """tiny-llama copied into the new folder `path` with `template` as its chat template: path."""
    import shutil

    from infer.models.tiny import ensure_builtin
    shutil.copytree(ensure_builtin("tiny-llama"), path)
    (path / "chat_template.jinja").write_text(template)
    return path


def tiny_llama_with_json(path, file: str, base: str = "tiny-llama", **changes):
    """tiny-llama (or the built-in tiny model `base`) copied into the new folder `path` with `changes` made to the
    fields of its JSON `file` (config.json, generation_config.json): path."""
    import json
    import shutil

    from infer.models.tiny import ensure_builtin
    shutil.copytree(ensure_builtin(base), path)
    fields = json.loads((path / file).read_text())
    (path / file).write_text(json.dumps({**fields, **changes}))
    return path


def tiny_chat_model(tmp_path_factory, name: str):
    """tiny-llama copied into a fresh folder with a minimal ChatML chat template (server probes)."""
    return tiny_llama_with_template(tmp_path_factory.mktemp(name) / "tiny", CHATML_TEMPLATE)


def tiny_chat_engine(tmp_path_factory, name: str):
    """An LLMEngine of tiny_chat_model(name) (block_size 4, up to 4 sequences)."""
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    return LLMEngine(EngineConfig(str(tiny_chat_model(tmp_path_factory, name)), block_size=4, max_num_seqs=4))


def openai_sdk_client(engine):
    """Yields the official OpenAI SDK's client (no retries) of `engine` served in a thread as "tiny" (a queue of 64);
    the server stops when the generator resumes."""
    import openai

    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    with serve_in_thread(Server(AsyncEngine(engine, max_queue=64), "tiny")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


def streamed_chat_choices(base: str, body: dict) -> list[dict]:
    """Each chunk's first choice of a streamed /v1/chat/completions answer to `body`."""
    import json

    import httpx
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
        return [json.loads(line[6:])["choices"][0] for line in s.iter_lines() if line.startswith("data: {")]


def infer_run_records(tmp_path, lines: list[dict], *args: str, key: str = "id",
                      model: str = "tiny-llama") -> tuple[dict, str]:
    """`infer run MODEL -q ARGS` on a jsonl file of `lines` (in tmp_path): its output records by `key` (an OpenAI
    batch output line's: custom_id), and what it printed."""
    import json

    from typer.testing import CliRunner

    from infer.cli.main import app
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    res = CliRunner().invoke(app, ["run", model, str(src), "-o", str(out), "-q", *args])
    return {r[key]: r for r in map(json.loads, out.read_text().splitlines())}, res.output


def forced_chat_body(messages: list[dict], reply: str, max_tokens: int, **extra) -> dict:
    """A greedy /v1/chat/completions body whose reply is forced with a regex, as if the model had written `reply`
    (xgrammar writes a tag as its own token)."""
    import re
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "guided_regex": re.escape(reply),
            **extra}


def tiny_llama_with_added_tokens(path, tokens: list[str], special: bool) -> str:
    """tiny-llama copied to `path` with `tokens` (think tags, harmony's markers) added to its tokenizer, `special` or
    not (ids past its vocabulary: the embedding and the head get zero rows for them)."""
    import json
    import shutil
    from safetensors.torch import load_file, save_file
    from infer.models.tiny import ensure_builtin
    shutil.copytree(ensure_builtin("tiny-llama"), path)
    tok = json.loads((path / "tokenizer.json").read_text())
    cfg = json.loads((path / "config.json").read_text())
    first = max([*tok["model"]["vocab"].values(), *(t["id"] for t in tok["added_tokens"])]) + 1
    for k, tag in enumerate(tokens):
        tok["added_tokens"].append(dict(id=first + k, content=tag, single_word=False, lstrip=False, rstrip=False,
                                        normalized=False, special=special))
    (path / "tokenizer.json").write_text(json.dumps(tok))
    weights = load_file(str(path / "model.safetensors"))
    for name, w in list(weights.items()):
        if w.dim() == 2 and w.shape[0] == cfg["vocab_size"]:
            weights[name] = torch.cat([w, w.new_zeros(first + len(tokens) - w.shape[0], w.shape[1])]).contiguous()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg["vocab_size"] = first + len(tokens)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def joined_deltas(deltas: list[dict], key: str) -> str:
    """The streamed choices' `delta[key]` pieces joined."""
    return "".join(d["delta"].get(key) or "" for d in deltas)


def joined_tool_calls(deltas: list[dict]) -> list[dict]:
    """The streamed choices' tool calls, each call's pieces joined as a client joins them: its first piece (the one
    with its id) gives the id, type and name, every piece at its `index` adds to the arguments."""
    calls: dict[int, dict] = {}
    for d in deltas:
        for piece in d["delta"].get("tool_calls") or []:
            if "id" in piece:
                assert piece["index"] not in calls, f"call {piece['index']} started twice"
                calls[piece["index"]] = {"id": piece["id"], "type": piece["type"],
                                         "function": {"name": piece["function"]["name"], "arguments": ""}}
            calls[piece["index"]]["function"]["arguments"] += piece["function"].get("arguments") or ""
    assert sorted(calls) == list(range(len(calls))), sorted(calls)
    return [calls[k] for k in range(len(calls))]


class StepGate:
    """Wrap engine.step so that a test holds the engine thread before each step while `open` is clear (timing-
    dependent server tests gate the engine, so they cannot flake on a loaded machine); `delay` slows every step;
    `closed`: held from the start. A step held `timeout` seconds goes on, and the test fails when the gate closes:
    a test whose step waits out the gate (a control it waits for needs the step to end first) lost that time."""

    def __init__(self, engine, delay: float = 0.0, closed: bool = False, timeout: float = 30.0):
        import threading
        self.engine, self.delay, self.open, self.timed_out = engine, delay, threading.Event(), False
        self.timeout = timeout
        if not closed:
            self.open.set()
        self.inner = engine.step

    def __enter__(self):
        def step():
            if not self.open.wait(self.timeout):
                self.timed_out = True
            if self.delay:
                time.sleep(self.delay)
            return self.inner()
        self.engine.step = step
        return self

    def __exit__(self, *exc):
        self.open.set()
        del self.engine.step
        assert exc[0] is not None or not self.timed_out, f"a step waited {self.timeout} s for the gate: the test " \
            "waited for it"


def wait_until(pred, timeout: float = 30.0) -> bool:
    """Poll `pred` (every 20 ms) until it holds or `timeout` seconds pass; whether it held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def metric_families(text: str) -> dict:
    """{(sample name, sorted labels): value} of a Prometheus exposition text (/metrics)."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def samples_by_engine(samples: dict, name: str, **labels) -> dict:
    """{engine label: value} of the samples called `name` whose other labels include `labels`."""
    out = {}
    for (n, lab), value in samples.items():
        d = dict(lab)
        if n == name and all(d.get(k) == v for k, v in labels.items()):
            out[d["engine"]] = value
    return out


def served_completion_text(base, served_name: str, prompt: list[int], max_tokens: int) -> str:
    """The text of a greedy /v1/completions reply (EOS ignored) from an in-process server of `base` named
    `served_name` (block_size 4, max_model_len 64)."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, create_app
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig(str(base), block_size=4, max_model_len=64))
    with TestClient(create_app(Server(AsyncEngine(engine), served_name))) as client:
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                 "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


class Stopped(Exception):
    """What stub_calls' stubs raise."""


def stub_calls(monkeypatch, *targets: str) -> dict:
    """Each of `targets` (dotted names) replaced by a stub that records its call's keyword arguments in the dict
    returned (its positional ones under "args"), then raises Stopped."""
    seen = {}

    def stub(*args, **kwargs):
        seen.update(kwargs, args=args)
        raise Stopped
    for target in targets:
        monkeypatch.setattr(target, stub)
    return seen


def served_tiny_llama(**config):
    """Yields the base URL of tiny-llama (max_model_len 64, up to 8 sequences, blocks of 4; `config`: other
    EngineConfig fields, runner="pooling"...) served in a thread as "tiny-llama"; the server stops when the
    generator resumes. Skips without fastapi."""
    pytest.importorskip("fastapi")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig("tiny-llama", **{"max_model_len": 64, "max_num_seqs": 8, "block_size": 4,
                                                     **config}))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny-llama")) as base:
        yield base


# Module-scoped fixtures that test modules import, most under another name (pytest finds a fixture under the name a
# module holds it by): `from helpers import tiny_llama_path as path, plain_llm as plain`. Each module gets its own.
# The LLM fixtures read the importing module's `path` fixture.
NGRAM_SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
FEW = [5, 6, 7, 8]  # allowed_token_ids that make tiny-llama's replies repetitive: n-gram drafts get proposed, accepted


@pytest.fixture(scope="module")
def tiny_llama_path():
    """tiny-llama's folder, a pathlib.Path."""
    from infer.models.tiny import ensure_builtin
    return ensure_builtin("tiny-llama")


@pytest.fixture(scope="module")
def tiny_llama_str():
    """tiny-llama's folder, a str."""
    from infer.models.tiny import ensure_builtin
    return str(ensure_builtin("tiny-llama"))


@pytest.fixture(scope="module")
def plain_llm(path):
    """An LLM of `path` in blocks of 4, left open."""
    from infer import LLM
    return LLM(str(path), block_size=4)


@pytest.fixture(scope="module")
def closing_llm(path):
    """An LLM of `path` in blocks of 4, closed at the end of the module."""
    from infer import LLM
    with LLM(path, block_size=4) as llm:
        yield llm


@pytest.fixture(scope="module")
def ngram_llm(path):
    """An LLM of `path` in blocks of 4 with n-gram speculation (NGRAM_SPEC)."""
    from infer import LLM
    return LLM(str(path), block_size=4, speculative_config=NGRAM_SPEC)


def drive_requests(llm, requests, on_output, arrive_every: int = 0) -> None:
    """Feed `requests` [(id, prompt, params)] to llm's engine (one new one every `arrive_every` steps, or all at once)
    and step it to the end; each output goes to on_output(out), and its request is aborted when that returns True.
    No block and no penalty-table row is left in use."""
    eng, pending = llm.engine, list(requests)
    while pending or eng.has_unfinished_requests():
        for _ in range(len(pending) if not arrive_every else 1):
            if pending:
                eng.add_request(*pending.pop(0))
        for _ in range(max(1, arrive_every)):
            for out in eng.step():
                if on_output(out):
                    eng.abort_request(out.request_id)
    assert eng.block_manager.num_used_blocks == 0
    assert not eng.runner.penalties.rows  # every request's penalty-table row went back with it


@contextlib.contextmanager
def served_in_sleep_mode(path):
    """The engine of `path` (max_model_len 64, up to 2 sequences, blocks of 4) with sleep mode on, served in a thread
    as "tiny": (its base URL, the LLMEngine). Skips without fastapi."""
    pytest.importorskip("fastapi")
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from infer.serve.app import Server, serve_in_thread
    from infer.serve.async_engine import AsyncEngine
    engine = LLMEngine(EngineConfig(path, block_size=4, max_model_len=64, max_num_seqs=2, enable_sleep_mode=True))
    with serve_in_thread(Server(AsyncEngine(engine), "tiny")) as url:
        yield url, engine


def run_async_llm(path, main, **engine) -> None:
    """asyncio.run(main(llm)) with llm an AsyncLLM of `path` (max_model_len 64, blocks of 4, and `engine`'s options),
    shut down after."""
    import asyncio

    from infer import AsyncLLM
    llm = AsyncLLM(path, block_size=4, max_model_len=64, **engine)
    try:
        asyncio.run(main(llm))
    finally:
        llm.shutdown()


def run_in_sleep_mode_async_llm(path, main) -> None:
    """run_async_llm with sleep mode on."""
    run_async_llm(path, main, enable_sleep_mode=True)


@contextlib.contextmanager
def stopped_after_each_record():
    """Within it, `infer run`'s output writer raises KeyboardInterrupt (a Ctrl-C) right after writing a record: the
    run stops with its first record on disk."""
    from infer.cli import batch_io
    real = batch_io.RecordWriter.write

    def write_then_stop(self, record):
        real(self, record)
        raise KeyboardInterrupt
    batch_io.RecordWriter.write = write_then_stop
    try:
        yield
    finally:
        batch_io.RecordWriter.write = real


class BenchTargetStub:
    """A bench plan's engine side (infer.bench.plan._Target) without an engine: a run at concurrency c runs nothing
    and answers RunResult(kind, c, self.records(), 1.0, len(requests)). Subclass it to change kind or records."""
    hf_dtype, hf_device = "float32", "cpu"
    kind = "infer"

    def __init__(self, plan, tokenizer):
        pass

    def warm_adapters(self, names):
        pass

    def records(self) -> list:
        return []

    def run(self, requests, c):
        from infer.bench.metrics import RunResult
        return RunResult(self.kind, c, self.records(), 1.0, len(requests))

    def close(self):
        pass


def check_reload_refuses_a_changed_config_field(tmp_path, builtin: str, key: str, value) -> None:
    """reload_weights of the built-in `builtin` whose config.json now gives `key` the value `value` (a field read
    when the layers are built) is refused naming the field and its value, with the hint to start a new engine, and
    the engine runs on with the tokens it gave before."""
    import re
    import shutil

    from infer import LLM, SamplingParams
    from infer.errors import ModelLoadError
    from infer.models.tiny import ensure_builtin
    src = ensure_builtin(builtin)
    shutil.copytree(src, tmp_path / "engine")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = random_prompts(100, (5, 9), seed=1)
    with LLM(str(tmp_path / "engine"), block_size=4, max_model_len=32) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        cfg = json.loads((src / "config.json").read_text())
        assert cfg.get(key) != value
        (tmp_path / "engine" / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ModelLoadError, match=f"config.json's {key} is {re.escape(str(value))} in the new") as e:
            llm.collective_rpc("reload_weights")
        assert "start a new engine" in e.value.hint
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want


def check_state_slots_all_free(llm) -> None:
    """A hybrid model's engine (Qwen3.5, Qwen3-Next): every state slot back in the pool, no KV block held."""
    states = llm.engine.block_manager.states
    assert states.num_free == states.num_slots == llm.engine.config.max_num_seqs
    assert llm.engine.block_manager.num_used_blocks == 0


def check_batched_chunks_equal_transformers(path, hf) -> None:
    """A hybrid model in `path`: three prompts (30, 17 and 1 tokens) batched in steps of 8 tokens (prefills cut into
    chunks, their states carried from a step to the next) give transformers' greedy tokens for each alone; every state
    slot free after."""
    from infer import LLM
    prompts = random_prompts(512, (30, 17, 1), seed=5)
    with LLM(str(path), block_size=4, max_num_batched_tokens=8, max_num_seqs=3) as llm:
        assert greedy_tokens(llm, prompts, 6) == greedy_each(hf, prompts, 6)
        check_state_slots_all_free(llm)


def check_chunked_prefill_carries_the_states(name: str, hf) -> None:
    """Built-in hybrid `name` in steps of 8 tokens: prompts of 30 and 41 tokens run in chunks whose states carry over,
    mixed with the others' decodes, and a prompt of one token: transformers' greedy tokens; every state slot given
    back."""
    from infer import LLM
    prompts = random_prompts(512, (30, 41, 1, 9), seed=5)
    with LLM(name, block_size=4, max_num_batched_tokens=8, max_num_seqs=4) as llm:
        steps = prompt_steps(llm)
        assert greedy_tokens(llm, prompts, 8) == greedy_each(hf, prompts, 8)
        assert max(steps) <= 8 and len(steps) > 10
        check_state_slots_all_free(llm)


def check_prefix_snapshot_restored(name: str, hf, then=None, **engine) -> None:
    """Built-in hybrid `name`: a 37-token prompt, then it with 7 more tokens (blocks of 4): the second finds the
    first's 9 full blocks and the states snapshotted at their end and computes its last 8 tokens alone; its logprobs
    are those of caching off (a zero state restored would move them) and the tokens transformers'. `then(llm,
    prompts, want)` runs on the caching engine (of `engine`'s options) after."""
    from infer import LLM
    from infer.engine.sampling_params import SamplingParams
    base = random_prompts(512, (37,), seed=6)[0]
    prompts = [base, base + [5, 6, 7, 8, 9, 10, 11]]
    want = greedy_each(hf, prompts, 6)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=1)
    with LLM(name, block_size=4, enable_prefix_caching=False) as llm:
        full = [llm.generate([p], params)[0] for p in prompts]
        assert [o.token_ids for o in full] == want
    with LLM(name, block_size=4, **engine) as llm:
        steps = prompt_steps(llm)
        outs = [llm.generate([p], params)[0] for p in prompts]
        for a, b in zip(outs[1].logprobs, full[1].logprobs):
            assert abs(a["logprob"] - b["logprob"]) < 1e-5
        assert llm.engine.block_manager.snapshots.restored == 1
        assert outs[1].num_cached_tokens == 36 and steps[-6:].count(0) >= 5
        check_state_slots_all_free(llm)
        if then is not None:
            then(llm, prompts, want)
    assert [o.token_ids for o in outs] == want


def check_sleep_frees_the_states_with_the_kv_cache(llm) -> None:
    """A hybrid's engine slept (level 1) frees its state slots and snapshots with the KV cache, their bytes together;
    woken after."""
    runner = llm.engine.runner
    kv_bytes = runner.kv_cache.untyped_storage().nbytes()
    llm.engine.sleep(level=1)
    assert sum(e.nbytes for e in llm.engine._sleep.slept["kv_cache"]) == \
        kv_bytes + runner.state_bytes + runner.snapshot_bytes
    llm.engine.wake_up()


def prompt_steps(llm) -> list[int]:
    """The prompt tokens each step of llm's engine computes from now on (a list it appends to)."""
    steps: list[int] = []
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def counted():
        batch = schedule()
        steps.append(sum(n for s, n in zip(batch.seqs, batch.num_new_tokens)
                         if s.num_computed_tokens < len(s.prompt_token_ids)))
        return batch
    scheduler.schedule = counted
    return steps


def state_tensors(llm) -> list[torch.Tensor]:
    """A hybrid model's linear-attention layers' conv and recurrent state tensors (every slot)."""
    return [t for layer in llm.engine.runner.model.linear_layers() for t in (layer.conv_state, layer.rec_state)]


def add_greedy_requests(engine, prompts, n: int, steps: int = 0) -> None:
    """Each prompt added to `engine` as request str(i), n greedy tokens (ignore_eos); then `steps` engine steps."""
    from infer import SamplingParams
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(max_new_tokens=n, ignore_eos=True))
    for _ in range(steps):
        engine.step()


def check_requests_finish_as_transformers(llm, hf, prompts, n: int) -> None:
    """The engine's requests (add_greedy_requests' of `prompts`) stepped to their end: transformers' n greedy tokens
    each; every state slot free after."""
    eng, out = llm.engine, {}
    while eng.has_unfinished_requests():
        out.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
    assert [out[str(i)] for i in range(len(prompts))] == greedy_each(hf, prompts, n)
    check_state_slots_all_free(llm)


def check_pooling_embeds_as_transformers(name: str, hf, prompts) -> None:
    """--runner pooling on the hybrid `name` (last-token pooling, normalized), prompts cut into steps of 8 tokens:
    transformers' last hidden state, normalized, of each prompt within 1e-4; every state slot back."""
    from infer import LLM
    with LLM(name, runner="pooling", block_size=4, max_num_batched_tokens=8, max_num_seqs=2) as llm:
        got = [torch.tensor(o.outputs.embedding) for o in llm.embed([{"prompt_token_ids": p} for p in prompts])]
        check_state_slots_all_free(llm)
    with torch.no_grad():
        for p, e in zip(prompts, got):
            want = torch.nn.functional.normalize(hf.model(torch.tensor([p])).last_hidden_state[0, -1], dim=0)
            assert torch.allclose(e, want, atol=1e-4)


def check_one_step_and_split_prompts(name: str, hf, prompts, step: int) -> None:
    """prompts[0] in one step and prompts[1] cut into steps of `step` tokens (blocks of 4): transformers' 6 greedy
    tokens each."""
    from infer import LLM
    want = greedy_each(hf, prompts, 6)
    with LLM(name, block_size=4) as llm:
        assert greedy_tokens(llm, prompts[:1], 6) == want[:1]
    with LLM(name, block_size=4, max_num_batched_tokens=step, max_num_seqs=2) as llm:
        assert greedy_tokens(llm, prompts[1:], 6) == want[1:]


def check_preemption_restarts_from_zero_state(name: str, hf) -> None:
    """A KV budget of 16 blocks of 4 for 4 prompts of the built-in `name`: some are preempted and recomputed from
    position 0 (zero state), and still give transformers' tokens; every state slot free after."""
    from infer import LLM
    from infer.models.tiny import ensure_builtin
    prompts = random_prompts(512, (20, 25, 17, 30), seed=4)
    with LLM(str(ensure_builtin(name)), block_size=4, num_kv_blocks=16, max_model_len=64) as llm:
        assert greedy_tokens(llm, prompts, 12) == greedy_each(hf, prompts, 12)
        assert llm.engine.scheduler.num_preemptions > 0
        check_state_slots_all_free(llm)


def check_prompt_logprobs_equal_transformers(hf, prompts, outs) -> None:
    """Every prompt token's logprob in `outs` (LLM.generate's of `prompts`, prompt_logprobs 0) is transformers' within
    1e-4."""
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            lp = hf(torch.tensor([p])).logits[0].log_softmax(-1)
            want = torch.tensor([lp[i, p[i + 1]].item() for i in range(len(p) - 1)])
            got = torch.tensor([d["logprob"] for d in o.prompt_logprobs[1:]])
            assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def check_gpu_graphs_equal_hf(path, prompts, lens, max_num_batched_tokens: int) -> None:
    """On a GPU: the model at `path` in float32, eager and under real CUDA graphs (4 sequences at most): `prompts`'
    greedy tokens (`lens` of them each) are transformers' both ways."""
    from infer import LLM, SamplingParams
    want = [hf_greedy(str(path), p, n) for p, n in zip(prompts, lens)]
    for eager in (True, False):
        with LLM(str(path), device="cuda", dtype="float32", max_num_seqs=4,
                 max_num_batched_tokens=max_num_batched_tokens, enforce_eager=eager) as llm:
            got = [o.token_ids for o in llm.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                                               for n in lens])]
            assert got == want, eager


def check_emulated_decode_graphs(name: str, hf, monkeypatch, triton: bool, check=None) -> None:
    """Decode steps of the state model `name` through (emulated) CUDA graphs: 5 sequences of different output lengths
    replay every bucket (1, 2, 4, 8) and give transformers' tokens, every state slot free after; `check(llm)` first
    where given. `triton`: every op that has a Triton kernel through it (interpreted; skipped on a GPU)."""
    from infer import LLM, SamplingParams
    if triton:
        if torch.cuda.is_available():
            pytest.skip("a GPU runs the real kernels and graphs")
        from infer import kernels
        monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    prompts = random_prompts(512, (5, 9, 3, 12, 7), seed=11)
    lens = [3, 5, 8, 11, 14]
    with LLM(name, max_num_seqs=8, block_size=4, num_kv_blocks=128, max_model_len=96, cuda_graph_max_tokens=16) as llm:
        llm.engine.runner.capture_graphs(96, emulate=True)
        if check is not None:
            check(llm)
        got = [o.token_ids for o in llm.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                                          for n in lens])]
        assert set(llm.engine.runner.graphs.replays) == {1, 2, 4, 8}
        check_state_slots_all_free(llm)
    assert got == [greedy_each(hf, [p], n)[0] for p, n in zip(prompts, lens)]


def check_warmup_counts_the_states(name: str, kv_per_token: int) -> dict:
    """`infer warmup NAME --estimate` (max length 256, 8 sequences, 256 MiB) counts the state slots the engine
    allocates and the KV of the attention layer alone (1 layer, `kv_per_token` bytes a token in float32). Returns
    the plan."""
    from infer import LLM
    from infer.memory.sizes import kv_bytes_per_token
    plan = estimated_plan(name, "--max-length", "256", "--max-num-seqs", "8", "--memory-limit", "256MiB")
    with LLM(name, max_model_len=256, max_num_seqs=8) as llm:
        assert plan["state_bytes"] == llm.engine.runner.state_bytes
        assert plan["kv_bytes_per_token"] == kv_bytes_per_token(llm.engine.model_config, torch.float32) == kv_per_token
        assert llm.engine.runner.kv_cache.shape[0] == 1  # (the attention layer's KV alone)
    return plan


def kill_actor(ray, handle) -> None:
    """ray.kill(handle), then wait until the actor is gone: ray.kill returns before its process has stopped, and a
    call sent meanwhile may still run there (a request routed to the replica began there and failed as started, or
    was even answered)."""
    ray.kill(handle, no_restart=True)
    for _ in range(1000):
        try:
            ray.get(handle.where.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            return
    pytest.fail("the killed replica still answers")
