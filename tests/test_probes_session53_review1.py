"""Session 53 review of the AWQ and sampling work: what an AWQ checkpoint must get wherever a GPTQ one does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

AWQ_QC = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


def _awq_config_dir(path: Path, **extra) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": AWQ_QC, **extra}))
    return path


def test_an_awq_base_records_the_model_an_adapter_was_trained_on(tmp_path):
    """AutoAWQ (under transformers 4) records the float model in config.json's _name_or_path, as GPTQ tools do: an
    adapter trained on that model is not warned about as trained for another one (as on its `convert --to gptq`)."""
    from infer.lora.validate import BaseInfo, base_name_warning
    from infer.quant.convert import recorded_source
    base = _awq_config_dir(tmp_path / "served-int4", _name_or_path="org/Some-Float-Model")
    assert recorded_source(base) == "org/Some-Float-Model"
    cfg = {"base_model_name_or_path": "org/Some-Float-Model"}
    assert base_name_warning("a", cfg, BaseInfo(base, None, "AWQ 4-bit, group 32"), str(base)) is None
    # a float folder's _name_or_path (the model it was fine-tuned from) is still not taken for its source
    flt = tmp_path / "float"
    flt.mkdir()
    (flt / "config.json").write_text(json.dumps({"model_type": "llama", "_name_or_path": "org/Some-Float-Model"}))
    assert recorded_source(flt) is None


@pytest.fixture(scope="module")
def awq_and_gptq(tmp_path_factory):
    """A reference AWQ checkpoint of a tiny float model (test_probes_session53_awq's packer) and its `infer convert
    --to gptq`: the same int4 layers, which the loader builds alike."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    from test_probes_session53_awq import float_model, write_awq
    base = float_model(tmp_path_factory.mktemp("review1"))
    awq, gptq = base.parent / "awq", base.parent / "gptq"
    write_awq(base, awq)
    res = CliRunner().invoke(app, ["convert", str(awq), "-o", str(gptq), "--to", "gptq"])
    assert res.exit_code == 0, res.output
    return awq, gptq


def test_warmup_estimate_counts_an_awq_checkpoint_as_its_gptq_conversion(awq_and_gptq):
    """The loader repacks each AWQ layer into GPTQ's layout: the estimate's weights are its GPTQ conversion's (an AWQ
    qweight [in, out / 8] read as GPTQ's [in / 8, out] counted each merged layer's g_idx 8 times too wide)."""
    from infer.cli.warmup_plan import estimate_plan
    from infer.engine.config import EngineConfig
    from infer.memory.checkpoint import checkpoint_weights_bytes
    from infer.models.loader import load_config, weight_files
    plans = [estimate_plan(EngineConfig(str(p), device="cpu", memory_limit=1 << 30), 64, 1)[0] for p in awq_and_gptq]
    assert plans[0].weights_bytes == plans[1].weights_bytes
    awq, gptq = awq_and_gptq
    on_gpu = [checkpoint_weights_bytes(weight_files(p), load_config(p), torch.float16, torch.device("cuda"), 4,
                                       awq=p == awq) for p in (awq, gptq)]
    assert on_gpu[0] == on_gpu[1]


def test_lora_validate_table_names_an_awq_base_awq(awq_and_gptq, tmp_path):
    """The table's base column says what the title says (AWQ), not GPTQ, for an AWQ base."""
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from infer.cli.main import app
    from test_lora_adapter import make_adapter
    awq = awq_and_gptq[0]
    adapter = make_adapter(tmp_path, "qv", base=AutoModelForCausalLM.from_pretrained(awq.parent / "float"))
    res = CliRunner().invoke(app, ["lora-validate", str(awq), f"qv={adapter}", "--steps", "0", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    row = next(line for line in res.output.splitlines() if line.startswith("│ qv "))
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert "AWQ" in cells and "GPTQ" not in cells, row


def test_an_awq_checkpoint_of_group_size_minus_one_loads_and_converts(awq_and_gptq, tmp_path):
    """group_size -1 (one group per output column: AutoAWQ's WQLinear takes it as in_features, vLLM's awq_marlin
    reads it) loads as GPTQ's -1 does: every layer dequantizes to the format's weight, and `convert --to gptq`
    writes the GPTQ checkpoint of group_size -1 with the same weights."""
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from infer.cli.main import app
    from infer.models.layers import MergedLinear
    from infer.models.loader import load_model
    from test_probes_session53_awq import LINEARS, awq_dequantize, awq_pack, awq_quantize
    src = awq_and_gptq[0].parent / "float"
    state, tensors, ref = load_file(src / "model.safetensors"), {}, {}
    for name, t in state.items():
        module = name.removesuffix(".weight")
        if not module.endswith(LINEARS):
            tensors[name] = t
            continue
        q, z, s = awq_quantize(t, group=t.shape[1])
        assert s.shape[0] == 1
        tensors.update({f"{module}.qweight": awq_pack(q), f"{module}.qzeros": awq_pack(z), f"{module}.scales": s})
        ref[module] = awq_dequantize(q, z, s, group=t.shape[1])
    awq = tmp_path / "awq"
    awq.mkdir()
    save_file(tensors, awq / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {**AWQ_QC, "group_size": -1}
    (awq / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (awq / f).write_bytes((src / f).read_bytes())
    gptq = tmp_path / "gptq"
    res = CliRunner().invoke(app, ["convert", str(awq), "-o", str(gptq), "--to", "gptq"])
    assert res.exit_code == 0, res.output
    assert json.loads((gptq / "config.json").read_text())["quantization_config"]["group_size"] == -1
    for path in (awq, gptq):
        model, _ = load_model(path, torch.float32, torch.device("cpu"))
        layers = [m for m in model.modules() if isinstance(m, MergedLinear)]
        for layer in layers:
            want = torch.cat([ref[n if n.startswith("model.") else f"model.{n}"] for n in layer.names]).float()
            assert torch.equal(layer.weight, want), (path.name, layer.names)
        assert sum(len(m.names) for m in layers) == len(ref)


def test_older_autoawq_quant_config_json_is_read_as_awq(awq_and_gptq, tmp_path):
    """Older AutoAWQ wrote its settings to quant_config.json only (w_bit, q_group_size, version; no quant_method),
    which the AWQ work reads: infer run loads such a folder as the same checkpoint with quantization_config in
    config.json (the loader took it for a float model, and the settings for GPTQ's), and convert --to gptq takes it."""
    import shutil

    from typer.testing import CliRunner

    from infer import LLM, SamplingParams
    from infer.cli.main import app
    from infer.quant.config import GPTQConfig
    awq = awq_and_gptq[0]
    old = tmp_path / "old-awq"
    shutil.copytree(awq, old)
    cfg = json.loads((old / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    (old / "config.json").write_text(json.dumps(cfg))
    (old / "quant_config.json").write_text(json.dumps({"zero_point": True, "q_group_size": qc["group_size"],
                                                       "w_bit": 4, "version": "GEMM"}))
    assert GPTQConfig.from_model_dir(old).quant_method == "awq"

    def greedy(path):
        llm = LLM(str(path), block_size=4)
        return [o.token_ids for o in llm.generate([[5, 17, 42, 9]], SamplingParams(max_new_tokens=4, ignore_eos=True))]
    assert greedy(old) == greedy(awq)
    res = CliRunner().invoke(app, ["convert", str(old), "-o", str(tmp_path / "gptq"), "--to", "gptq"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "gptq" / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"


def test_quantize_refuses_an_older_autoawq_folder_before_loading_it(tmp_path):
    """A folder whose only quantization settings are AutoAWQ's quant_config.json is an AWQ checkpoint: `infer
    quantize` refuses it up front (GPTQModel refused it only after loading the model)."""
    from typer.testing import CliRunner

    from infer.cli.main import app
    src = tmp_path / "old-awq"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (src / "quant_config.json").write_text(json.dumps({"zero_point": True, "q_group_size": 32, "w_bit": 4,
                                                       "version": "GEMM"}))
    res = CliRunner().invoke(app, ["quantize", str(src), "-o", str(tmp_path / "out"), "--group-size", "32"])
    assert res.exit_code == 2 and "already an AWQ checkpoint" in res.output, res.output
    assert not (tmp_path / "out").exists()


def test_vllms_quantization_keyword_says_awq_is_read_from_the_config():
    """vLLM's AutoAWQ example passes quantization="AWQ": now that infer reads AWQ checkpoints, the hint that refuses
    the keyword (and --quantization) says AWQ is read from config.json too, not only GPTQ."""
    from infer import LLM
    from infer.cli.vllm_flags import VLLM_HINTS
    from infer.errors import UnknownOptionError
    with pytest.raises(UnknownOptionError) as e:
        LLM("tiny-llama", quantization="AWQ")
    assert "AWQ" in e.value.hint and "AWQ" in VLLM_HINTS["--quantization"]


def test_a_tied_prompt_token_among_the_top_k_has_its_place_as_its_rank_as_vllm():
    """vLLM builds each prompt position's {token id: Logprob} from the token's own entry (rank: the tokens at least as
    likely) followed by the top-k (ranks 1..k), so a token that is also among the top-k shows its place there; infer
    kept the count, which differs when the token ties with another (bf16 logits tie often)."""
    from types import SimpleNamespace

    from infer.serve.protocol import prompt_logprobs
    tok = SimpleNamespace(decode=lambda ids: f"t{ids[0]}")
    rec = {"token_id": 7, "logprob": -0.5, "rank": 2,  # 7 ties with 3 for the top: 2 tokens at least as likely
           "top_logprobs": [{"token_id": 7, "logprob": -0.5}, {"token_id": 3, "logprob": -0.5},
                            {"token_id": 9, "logprob": -2.0}]}
    out = prompt_logprobs([None, rec], tok, 3)[1]
    assert list(out) == ["7", "3", "9"]
    assert [out[i]["rank"] for i in ("7", "3", "9")] == [1, 2, 3]
    below = {**rec, "top_logprobs": rec["top_logprobs"][1:2]}  # not among the top-1: its own rank
    assert prompt_logprobs([None, below], tok, 1)[1]["7"]["rank"] == 2


def test_the_model_argument_and_the_int_tensor_hint_name_awq(tmp_path):
    """`infer run/serve/bench --help` describe MODEL as float, GPTQ or AWQ; an int tensor in a folder without a
    quantization config is told infer runs GPTQ and AWQ checkpoints (AWQ was left out of both)."""
    import typing

    from infer.cli import options
    from infer.errors import ModelLoadError
    from infer.models.loader import _check_kind
    assert "AWQ" in typing.get_args(options.Model)[1].help
    with pytest.raises(ModelLoadError) as e:
        _check_kind("x.weight", torch.zeros(2, dtype=torch.int32), torch.zeros(2))
    assert "AWQ" in e.value.hint
