"""vLLM's LoRARequest: `generate(..., lora_request=LoRARequest(name, id, path))` (and `chat`, `stream`,
`LLMEngine.add_request`, `AsyncLLM.generate`) registers the folder under its name on first use and runs it as
`lora=name`: the tokens are peft's; the same name from another folder, both lora and lora_request, or an engine
without adapter slots are refused naming the fix."""

from __future__ import annotations

import asyncio

import pytest
import torch

from infer import LLM, AsyncLLM, LoRARequest, SamplingParams
from infer.errors import LoRAError, LoRANameError, RequestError

from helpers import tiny_llama_str as path  # noqa: F401 (a fixture)
from lora_helpers import hf_float, save_three

P = SamplingParams(max_new_tokens=5, ignore_eos=True)
PROMPT = [5, 9, 13, 21]


@pytest.fixture(scope="module")
def adapters(path, tmp_path_factory):
    return save_three(hf_float(path), tmp_path_factory.mktemp("lr"), 7, "ab")


def _peft(path, adapter) -> list[int]:
    from peft import PeftModel
    model = PeftModel.from_pretrained(hf_float(path), str(adapter)).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=5, do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def test_generate_registers_a_lora_request_and_runs_it(path, adapters):
    want = {n: _peft(path, p) for n, p in adapters.items()}
    with LLM(path, block_size=4, max_model_len=64, enable_lora=True, max_lora_rank=8) as llm:
        a, b = LoRARequest("a", 1, str(adapters["a"])), LoRARequest("b", 2, str(adapters["b"]))
        assert llm.generate([PROMPT], P, lora_request=a)[0].token_ids == want["a"]
        assert llm.list_loras() == ["a"]
        outs = llm.generate([PROMPT] * 3, P, lora_request=[b, None, a])  # one per prompt, None the base
        assert [o.token_ids for o in outs[::2]] == [want["b"], want["a"]] and outs[1].token_ids not in want.values()
        assert llm.list_loras() == ["a", "b"]
        chat = llm.chat([{"role": "user", "content": "hi"}], P, lora_request=a)
        assert chat[0].lora == "a"
        streamed = [o for _, _, o in llm.stream([PROMPT], P, lora_request=a) if o.finished]
        assert streamed[0].token_ids == want["a"]
        with pytest.raises(LoRANameError, match="registered from") as e:
            llm.generate([PROMPT], P, lora_request=LoRARequest("a", 3, str(adapters["b"])))
        assert "replace=True" in e.value.hint
        with pytest.raises(RequestError, match="both lora and lora_request"):
            llm.generate([PROMPT], P, lora="a", lora_request=a)
        engine = llm.llm_engine
        engine.add_request("e", PROMPT, P, lora_request=b)
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        assert done["e"] == want["b"]


def test_an_engine_without_slots_says_to_enable_lora(path, adapters):
    with LLM(path, block_size=4, max_model_len=64) as llm:
        with pytest.raises(LoRAError, match="no LoRA adapter slots") as e:
            llm.generate([PROMPT], P, lora_request=LoRARequest("a", 1, str(adapters["a"])))
        assert "enable_lora=True" in e.value.hint


@pytest.mark.parametrize("args, match", [(("", 1, "/x"), "lora_name"), (("a", 0, "/x"), "lora_int_id"),
                                         (("a", True, "/x"), "lora_int_id"), (("a", 1), "no lora_path")])
def test_a_bad_lora_request_is_refused(args, match):
    with pytest.raises(RequestError, match=match):
        LoRARequest(*args)


def test_vllms_older_lora_local_path_and_async_llm(path, adapters):
    want = _peft(path, adapters["b"])

    class VllmStyle:  # vLLM's object, read by its attributes
        lora_name, lora_int_id, lora_path, lora_local_path = "bb", 4, "", str(adapters["b"])

    llm = AsyncLLM(path, block_size=4, max_model_len=64, enable_lora=True, max_lora_rank=8)
    try:
        async def main():
            outs = [o async for o in llm.generate(PROMPT, P, "r1", lora_request=VllmStyle())]
            again = [o async for o in llm.generate(PROMPT, P, "r2", lora_request=VllmStyle())]
            return outs[-1].token_ids, again[-1].token_ids
        assert asyncio.run(main()) == (want, want)
        assert llm.list_loras() == ["bb"]
    finally:
        llm.shutdown()
