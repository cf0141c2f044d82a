"""LLM: the Python API. `LLM(path).generate(prompts, params)` and `LLM(path).stream(prompts, params)`."""

from __future__ import annotations

from typing import Iterator, Sequence as Seq

from ..errors import RequestError
from .config import EngineConfig
from .inputs import encode_prompt
from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Prompt = str | list[int] | list[dict]  # text, token ids, or chat messages


class LLM:
    """Example: `LLM("tiny-llama").generate(["Hello"], SamplingParams(max_new_tokens=16))[0].text`."""

    def __init__(self, model: str, **engine_options):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def close(self) -> None:
        """Free the engine's device memory (KV cache, CUDA graphs, weights) now rather than at garbage collection;
        `with LLM(...) as llm:` does it on leaving the block."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return encode_prompt(self.tokenizer, prompt=prompt)
        if prompt and isinstance(prompt[0], dict):
            return encode_prompt(self.tokenizer, messages=prompt)
        return list(prompt)

    def _submit(self, prompts, params, lora) -> list[str]:
        """Queue every prompt, or none: a bad one raises with the ones before it taken back out of the engine."""
        if self.engine is None:
            raise RuntimeError("this LLM was closed (LLM.close()); create a new LLM to generate again")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise RequestError(f"prompts must be a string, a list of token ids, chat messages, or a list of those; "
                               f"got {type(prompts).__name__}")
        n = len(prompts)
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * n
        loras = lora if isinstance(lora, list) else [lora] * n
        for what, items in (("SamplingParams", params_list), ("lora", loras)):
            if len(items) != n:
                raise RequestError(f"{n} prompts but {len(items)} {what}", f"give one {what} per prompt, or one "
                                                                          "for all")
        if not all(isinstance(sp, SamplingParams) for sp in params_list):
            raise RequestError("params must be a SamplingParams or a list of them", "e.g. SamplingParams("
                                                                                     "max_new_tokens=32)")
        ids: list[str] = []
        try:
            for p, sp, lo in zip(prompts, params_list, loras):
                self._counter += 1
                rid = f"llm-{self._counter}"
                self.engine.add_request(rid, self._encode(p), sp, lo)
                ids.append(rid)
        except BaseException:
            self._abort(ids)
            raise
        return ids

    def _abort(self, ids) -> None:
        """Stop these requests now (their KV blocks are freed; the next step hands out their abort outputs)."""
        for rid in ids:
            self.engine.abort_request(rid)

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 lora: str | list[str | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion (batched together); outputs in the order of the prompts."""
        ids = self._submit(prompts, params, lora)
        wanted, done = set(ids), {}
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
        except BaseException:  # Ctrl-C or an engine error: leave no request of this call running
            self._abort([i for i in ids if i not in done])
            raise
        return [done[i] for i in ids]

    def stream(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
               lora: str | list[str | None] | None = None) -> Iterator[tuple[int, str, RequestOutput]]:
        """Yield (prompt index, text delta, output) as tokens arrive; the last event of a prompt has finished set."""
        ids = self._submit(prompts, params, lora)
        index = {rid: i for i, rid in enumerate(ids)}
        left = set(ids)
        try:
            while left:
                for out in self.engine.step():
                    if out.request_id in index:
                        if out.finished:
                            left.discard(out.request_id)
                        yield index[out.request_id], out.delta_text, out
        finally:
            for rid in left:  # the caller stopped early: free what is still running
                self.engine.abort_request(rid)
