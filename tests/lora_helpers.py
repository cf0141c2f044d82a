"""Shared helpers for tests that need PEFT adapters on a built-in tiny model, and peft as the oracle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quant_helpers import needs_gptqmodel

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Three small adapters with different ranks and target sets (name -> LoraConfig arguments).
THREE = {
    "a": dict(r=4, lora_alpha=8, target_modules=ALL),
    "b": dict(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "c": dict(r=6, lora_alpha=12, use_rslora=True, target_modules=["k_proj", "o_proj", "up_proj"]),
}


def hf_float(path):
    from helpers import _auto_class  # (a multimodal model's class: Mistral 3's has no causal LM one)
    m = _auto_class(json.loads((Path(path) / "config.json").read_text())).from_pretrained(
        path, dtype=torch.float32).eval()
    m.generation_config.eos_token_id = None  # never stop: compare with ignore_eos
    return m


def save_adapter(hf, out, seed: int, scale: float = 0.15, **lora_kw):
    """A peft adapter on `hf` with random non-zero A and B (B is zero at init; normal, times `scale`), saved to `out`;
    hf is restored."""
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(hf, LoraConfig(**lora_kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(str(out))
    model.unload()
    return out


def save_adapters(hf, root, adapters: dict, scale: float = 0.15) -> dict:
    """Each of `adapters` (name -> LoraConfig arguments) on `hf`, saved under root / name (seeds 1, 2, ... in order;
    no dropout; save_adapter's `scale`): {name: path}."""
    return {n: save_adapter(hf, root / n, seed=i + 1, scale=scale, lora_dropout=0.0, **kw) for i, (n, kw) in
            enumerate(adapters.items())}


def base_and_adapters(root, adapters: dict, build=None, scale: float = 0.15):
    """The float model saved in root / "base" (by `build`(root / "base") first where given) and `adapters` on it,
    saved under root (save_adapters, at `scale`): (base folder, the model in transformers, {name: path})."""
    if build is not None:
        build(root / "base")
    hf = hf_float(root / "base")
    return root / "base", hf, save_adapters(hf, root, adapters, scale)


def builtin_and_adapters(root, name: str, adapters: dict, scale: float = 0.15):
    """(the built-in `name`'s folder, its model in transformers, {adapter: path}) of `adapters` (peft's, at `scale`:
    save_adapters) saved under root."""
    from infer.models.tiny import ensure_builtin
    base = ensure_builtin(name)
    hf = hf_float(base)
    return base, hf, save_adapters(hf, root, adapters, scale)


def check_expert_adapters_equal_peft(base, hf, paths: dict, names: list, prompts) -> None:
    """The engine's greedy tokens (6) of `prompts`, each with its adapter of `names` (None: the base), in one mixed
    batch and each alone, equal peft's, each adapter loaded alone in peft (it holds several target_parameters
    adapters only where they target the same parameters); the first and last prompts' adapters change their tokens."""
    from helpers import greedy_each
    from test_probes_session57_moelora import _engine_tokens, peft_tokens
    mixed, alone = _engine_tokens(base, paths, prompts, names)
    want = peft_tokens(hf, paths, prompts, names)
    assert mixed == want and alone == want
    plain = greedy_each(hf, prompts, 6)
    assert want[0] != plain[0] and want[-1] != plain[-1]


def adapter_with_module(src, folder, module: str, r: int, cols: int, rows: int) -> Path:
    """A copy of the peft adapter `src` in `folder` with random LoRA weights on `module` too (model.`module`: A
    [r, cols], B [rows, r]) and its last name added to target_modules: an adapter of a module infer may refuse.
    Returns folder."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, folder)
    tensors = load_file(Path(folder) / "adapter_model.safetensors")
    tensors[f"base_model.model.model.{module}.lora_A.weight"] = torch.randn(r, cols)
    tensors[f"base_model.model.model.{module}.lora_B.weight"] = torch.randn(rows, r)
    save_file(tensors, Path(folder) / "adapter_model.safetensors")
    config = json.loads((Path(folder) / "adapter_config.json").read_text())
    config["target_modules"] += [module.rpartition(".")[2]]
    (Path(folder) / "adapter_config.json").write_text(json.dumps(config))
    return Path(folder)


# the stacked experts of Granite MoE and GraniteMoeShared (peft's target_parameters)
GRANITE_EXPERTS = ["block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.experts.down_proj"]


def check_granite_adapters_equal_peft(root, build) -> None:
    """Adapters of the attention and the stacked experts of the Granite MoE model that `build`(root / "base") writes,
    each alone and mixed with the base in one batch: peft's tokens (check_all8_qv4_equal_peft). Their weights at
    0.5's scale: Granite's residual_multiplier of 0.22 leaves 0.15's deltas too small to change a token."""
    adapters = {"all8": dict(r=8, lora_alpha=16, target_modules=ALL[:4], target_parameters=GRANITE_EXPERTS),
                "qv4": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                            target_parameters=GRANITE_EXPERTS)}
    check_all8_qv4_equal_peft(*base_and_adapters(root, adapters, build, scale=0.5))


# an adapter of every projection and one of some, in Llama's names (family_base_and_adapters: base_targets maps them)
FAMILY_ADAPTERS = {"all8": dict(r=8, lora_alpha=16, target_modules=ALL),
                   "qv4": dict(r=4, lora_alpha=4,
                               target_modules=["q_proj", "v_proj", "o_proj", "down_proj", "up_proj"])}


def family_base_and_adapters(tmp_path_factory, build, family: str, **config):
    """(family, base folder, transformers' model, {name: adapter}) of FAMILY_ADAPTERS (their target_modules the
    family's modules: base_targets) on a base of `family` that `build(folder, family, **config)` writes."""
    from infer.lora.adapter import base_targets
    root = tmp_path_factory.mktemp(family)
    build(root / "base", family, **config)
    adapters = {name: {**kw, "target_modules": base_targets(family, kw["target_modules"])}
                for name, kw in FAMILY_ADAPTERS.items()}
    return (family, *base_and_adapters(root, adapters))


def check_lora_validate_ok(base, adapter) -> None:
    """`infer lora-validate BASE ADAPTER --json` (two steps) reports the adapter fits, its shapes too."""
    import json

    from typer.testing import CliRunner

    from infer.cli.main import app
    res = CliRunner().invoke(app, ["lora-validate", str(base), str(adapter), "--json", "--steps", "2"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["shapes"] == "ok"


def check_all8_qv4_equal_peft(base, hf, paths: dict) -> None:
    """check_mixed_adapters_equal_peft of adapters "all8" and "qv4" (FAMILY_ADAPTERS' names, ADAPTERS' of a family's
    test file) and the base between them, on prompts of 5, 20 and 8 tokens."""
    from helpers import random_prompts
    check_mixed_adapters_equal_peft(base, hf, paths, random_prompts(512, (5, 20, 8), seed=6), ["all8", None, "qv4"])


def check_mixed_adapters_equal_peft(base, hf, paths: dict, prompts, names, n: int = 6, **engine) -> None:
    """The engine's greedy tokens of `prompts`, each with its adapter of `names` (None: the base), in one mixed batch
    and each alone, equal peft's; the first prompt's adapter changes its tokens (so the check means something).
    `engine`: more LLM options (e.g. lora_target_modules)."""
    from infer import LLM, SamplingParams
    oracle = PeftOracle(hf, paths)
    try:
        with LLM(str(base), loras={k: str(p) for k, p in paths.items()}, max_loras=2, max_lora_rank=8,
                 block_size=4, **engine) as llm:
            params = SamplingParams(max_new_tokens=n, ignore_eos=True)
            mixed = [o.token_ids for o in llm.generate(prompts, params, lora=names)]
            alone = [llm.generate([p], params, lora=a)[0].token_ids for p, a in zip(prompts, names)]
        want = [oracle.greedy(a, p, n) for p, a in zip(prompts, names)]
        assert mixed == want and alone == want
        assert want[0] != oracle.greedy(None, prompts[0], n)
    finally:
        oracle.close()


def check_mlp_names_adapter_equals_peft(base, hf, root, attention: str, modules: set) -> None:
    """An adapter of target_modules `attention`, gate_proj, up_proj and down_proj (r 4, alpha 8) on a mixture of
    experts `hf`, saved under root: it holds `modules` (peft >= 0.22 keeps those names on the Linear layers they
    reach, a dense layer's MLP and the shared experts, and turns them into the experts' parameters too, gate_up_proj
    at twice the rank), and served mixed with the base it gives peft's tokens (check_mixed_adapters_equal_peft)."""
    from helpers import random_prompts
    from infer.lora.adapter import read_adapter
    # (an adapter of its own: peft holds several only where their target_parameters agree)
    paths = save_adapters(hf, root, {"mlp4": dict(r=4, lora_alpha=8, target_modules=[
        attention, "gate_proj", "up_proj", "down_proj"])})
    held = set(read_adapter("mlp4", paths["mlp4"]).modules)
    assert modules <= held, held
    check_mixed_adapters_equal_peft(base, hf, paths, random_prompts(512, (7, 12), seed=4), ["mlp4", None])


def check_attention_adapters_equal_peft(base, hf, tmp_path) -> None:
    """check_mixed_adapters_equal_peft of two adapters saved under tmp_path, "all" (every attention projection, rank
    8) and "qv" (q and v, rank 4), and the base between them, on prompts of 7, 13 and 22 tokens (a hybrid model's)."""
    from helpers import random_prompts
    # (B and A drawn at 0.5: at lora_helpers' 0.15, adapters of the one attention layer of 4 leave the tokens as the
    # base's)
    paths = {name: save_adapter(hf, tmp_path / name, i + 1, 0.5, lora_dropout=0.0, **kw) for i, (name, kw) in
             enumerate({"all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
                        "qv": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"])}.items())}
    check_mixed_adapters_equal_peft(base, hf, paths, random_prompts(512, (7, 13, 22), seed=2), ["all", None, "qv"])


def save_three(hf, root, seed: int, names: str = "abc") -> dict:
    """The adapters of THREE named in `names` on `hf`, saved under root / name (seeds seed, seed + 1, ... in order):
    {name: path}."""
    from pathlib import Path
    return {name: save_adapter(hf, Path(root) / name, seed=seed + i, **THREE[name]) for i, name in enumerate(names)}


def three_adapters(root, seed: int, names: str = "abc"):
    """tiny-llama's float model and the adapters of THREE named in `names` saved under `root` (seeds seed, seed + 1,
    ...): (hf, {name: path})."""
    from pathlib import Path

    from infer.models.tiny import ensure_builtin
    hf = hf_float(Path(ensure_builtin("tiny-llama")))
    return hf, save_three(hf, root, seed, names)


class PeftOracle:
    """peft's greedy tokens for (adapter or None, prompt, n), one row at a time, remembered across calls."""

    def __init__(self, hf, adapters: dict):
        from peft import PeftModel
        self.model = None
        for name, path in adapters.items():
            if self.model is None:
                self.model = PeftModel.from_pretrained(hf, str(path), adapter_name=name)
            else:
                self.model.load_adapter(str(path), adapter_name=name)
        self.memo: dict[tuple, list[int]] = {}

    def greedy(self, name: str | None, prompt: list[int], n: int) -> list[int]:
        key = (name, tuple(prompt), n)
        if key not in self.memo:
            self.memo[key] = self._generate(name, prompt, n)
        return self.memo[key]

    @torch.no_grad()
    def _generate(self, name, prompt, n):
        ids = torch.tensor([prompt])
        kw = dict(max_new_tokens=n, do_sample=False, pad_token_id=0)
        if name is None:
            with self.model.disable_adapter():
                out = self.model.generate(input_ids=ids, **kw)
        else:
            self.model.set_adapter(name)
            out = self.model.generate(input_ids=ids, **kw)
        return out[0, len(prompt):].tolist()

    def close(self) -> None:
        self.model.unload()


def check_mixed_adapters_gpu_path_equal_peft(base, hf, paths: dict, monkeypatch, check_model, **engine) -> None:
    """Prompts of 5, 3 and 7 tokens mixed as adapter all8, the base alone and qv4 (of `paths`, on `hf`): an LLM of
    `base` with the adapters, every op through its Triton kernel (interpreted on CPU) and decodes through emulated
    CUDA graphs (some replayed), gives peft's tokens (4 each); `check_model(model)` first checks the engine's
    model. `engine`: more LLM options (e.g. lora_expand_fused)."""
    from helpers import random_prompts
    from infer import LLM, SamplingParams
    from quant_helpers import int4_kernel_path
    oracle = PeftOracle(hf, paths)
    try:
        prompts = random_prompts(512, (5, 3, 7), seed=9)
        names = ["all8", None, "qv4"]
        want = [oracle.greedy(n, p, 4) for p, n in zip(prompts, names)]
    finally:
        oracle.close()
    int4_kernel_path(monkeypatch)
    with LLM(str(base), loras={n: str(p) for n, p in paths.items()}, max_loras=2, max_lora_rank=8, block_size=4,
             max_model_len=32, max_num_seqs=4, cuda_graph_max_tokens=4, **engine) as llm:
        check_model(llm.engine.runner.model)
        llm.engine.runner.capture_graphs(8, emulate=True)
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True),
                                                 lora=names)]
        assert sum(llm.engine.runner.graphs.replays.values()) > 0
    assert got == want


def finish_all(engine) -> dict[str, list[int]]:
    """Step an LLMEngine until nothing is left: {request id: its generated token ids}."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    return done


def check_no_target_modules_refused_as_peft(base, adapter, folder, family: str):
    """A copy (in `folder`) of `adapter` without target_modules, on a base of `family` peft has no default for:
    PeftModel.from_pretrained refuses it ("Please specify `target_modules`") and so does infer's engine, naming the
    family. Returns the copy's path."""
    import json
    import shutil

    import pytest
    from peft import PeftModel

    from infer import LLM
    from infer.errors import LoRAError
    path = shutil.copytree(adapter, folder)
    cfg = json.loads((path / "adapter_config.json").read_text())
    del cfg["target_modules"]
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Please specify `target_modules`"):
        PeftModel.from_pretrained(hf_float(base), str(path))
    with pytest.raises(LoRAError, match=f"peft has no default for a {family} base"):
        LLM(str(base), loras={"a": str(path)})
    return path


def check_lora_validate_ok_and_non_linear_regexes(base, paths: dict, folder, cases) -> None:
    """lora-validate accepts the adapter of every projection (paths["all8"]: check_lora_validate_ok); for each
    (target_modules regex, module) of `cases`, a copy (in `folder`) of paths["qv4"] with that regex: adapter_problems
    names layers.0.MODULE as not a Linear layer (peft refuses such an adapter), or, where module is None, no module
    of the kind (the regex selects nothing more than the adapter's projections)."""
    import json
    import shutil

    from transformers import AutoConfig

    from infer.lora.adapter import adapter_problems
    check_lora_validate_ok(base, paths["all8"])
    path = shutil.copytree(paths["qv4"], folder)
    config = json.loads((path / "adapter_config.json").read_text())
    for regex, module in cases:
        (path / "adapter_config.json").write_text(json.dumps({**config, "target_modules": regex}))
        problems = [str(p) for p in adapter_problems("a", path, AutoConfig.from_pretrained(base))]
        hits = [p for p in problems if "which is not a Linear layer" in p]
        if module is None:
            assert not hits, problems
        else:
            assert hits and f"layers.0.{module}" in hits[0], problems


# ------------------------------------------------------------------------------------------ family test files' LoRA
# A family test file (tests/test_probes_session*_fam*.py) takes these by name: `family_lora = family_lora_fixture(...)`
# and `from lora_helpers import test_...`, pytest collecting them as the file's own tests on its family_lora.
def family_lora_fixture(build, biases: dict):
    """The module fixture `family_lora`, one param a family of `biases` ({family: the config turning its biases on}):
    (family, base folder, transformers' model, {name: adapter}) of FAMILY_ADAPTERS on a base of the family (biases
    on)."""
    @pytest.fixture(scope="module", params=list(biases))
    def family_lora(request, tmp_path_factory):
        return family_base_and_adapters(tmp_path_factory, build, request.param, **biases[request.param])
    return family_lora


def test_peft_adapters_equal_peft_alone_and_mixed(family_lora):
    check_all8_qv4_equal_peft(*family_lora[1:])


@needs_gptqmodel
def test_int4_kernels_with_mixed_adapters_equal_the_cpu_path(family_lora, tmp_path, monkeypatch):
    """A GPTQ checkpoint of the base with the adapters mixed: the int4 kernels (interpreted), their silu in gate_up's
    epilogue, give the CPU path's tokens."""
    from quant_helpers import check_int4_kernels_with_mixed_adapters
    _, base, _, paths = family_lora
    check_int4_kernels_with_mixed_adapters(base, paths, tmp_path, monkeypatch, ["all8", None, "qv4"], True)


def test_lora_validate_accepts_an_adapter_of_every_projection(family_lora):
    _, base, _, paths = family_lora
    check_lora_validate_ok(base, paths["all8"])


def test_an_adapter_without_target_modules_is_refused_as_peft_refuses_it(family_lora, tmp_path):
    """peft has no default target_modules for these bases (its mapping names none of them): PeftModel.from_pretrained
    refuses a config without them ("Please specify `target_modules`"), and so do infer's engine and lora-validate,
    naming the base's model_type."""
    from transformers import AutoConfig

    from infer.lora.adapter import adapter_problems
    _, base, _, paths = family_lora
    config = AutoConfig.from_pretrained(base)
    path = check_no_target_modules_refused_as_peft(base, paths["all8"], tmp_path / "a", config.model_type)
    [problem] = adapter_problems("a", path, config)
    assert f"peft has no default for a {config.model_type} base" in str(problem)


def test_adapter_without_target_modules_is_refused_as_peft_does(family_lora, tmp_path):
    """peft has no default target_modules for these bases: PeftModel.from_pretrained refuses a config without them
    ("Please specify `target_modules`"), and so does infer's engine."""
    family, base, _, paths = family_lora
    check_no_target_modules_refused_as_peft(base, paths["all8"], tmp_path / "a", family)


def test_serve_completions(family_lora):
    from helpers import check_served_completion_equals_transformers
    family, base, hf, _ = family_lora
    check_served_completion_equals_transformers(base, family, hf)


def check_expert_target_modules_adapter(base, stacked, folder, names: list[str]) -> None:
    """The adapter at `stacked` (the experts' stacked parameters in target_parameters) copied to `folder` with the
    experts named instead by transformers 4's `names` in target_modules (peft turns those into the stacked
    parameters): infer's checks pass it and it gives the stacked adapter's greedy tokens."""
    import json
    import shutil

    from transformers import AutoConfig

    from helpers import greedy_tokens, random_prompts
    from infer import LLM
    from infer.lora.adapter import adapter_problems
    shutil.copytree(stacked, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["target_modules"] = sorted(config["target_modules"]) + list(names)
    config.pop("target_parameters")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    assert adapter_problems("v4", folder, AutoConfig.from_pretrained(base)) == []
    prompts = random_prompts(512, (6, 9), seed=2)
    with LLM(str(base), loras={"qv4": str(stacked), "v4": str(folder)}) as llm:
        assert greedy_tokens(llm, prompts, 5, lora=["v4", "v4"]) == greedy_tokens(llm, prompts, 5, lora=["qv4", "qv4"])
