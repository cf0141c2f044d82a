"""HTTP benchmark driver: any OpenAI-compatible server (`infer serve`, vLLM, SGLang, llama.cpp ...).

    from infer.bench.http_driver import run_http
    result = run_http("http://127.0.0.1:8000", "my-model", workload.requests, concurrency=16)

Each request is a streamed POST /v1/completions (`stream: true`, `stream_options: {include_usage: true}`,
greedy, `max_tokens` = output length, `ignore_eos` when the workload asks for it, as vLLM accepts it); a request
with a LoRA adapter names the adapter as its model, as vLLM serves adapters. The prompt is sent as its token ids
when the request has them (OpenAI's and vLLM's completions accept a list of ids), so the server runs the very
prompt the in-process engine runs: sent as text it would be tokenized again (another length, a BOS added).
Every SSE `data:` chunk with a choice is time-stamped, with text or not (an EOS or special token has none), as
vLLM's benchmark does, but for a last chunk without text beyond the token count (it only says why the request
finished, as OpenAI's last chunk does). Output tokens come from the final usage chunk (else from `tokenizer`,
else one per chunk with text; at least one), and so do the prompt tokens found cached, its
usage.prompt_tokens_details.cached_tokens (vLLM's --enable-prompt-tokens-details), when the server sends them.
A stream the server cut off (the connection closed with neither a finish_reason nor `data: [DONE]`) is a failed
request, not a completed one of the tokens it got.
A pooling run's request (embeddings: `pooling`) is a POST /v1/embeddings of the prompt's token ids, done when
its vector comes back (its E2EL; its prompt tokens the usage's).
Memory figures are those of this client process, not of the server.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time

from ..errors import ConfigError, InferError
from .datasets import BenchRequest
from .driver import Progress, arrival_offsets
from .metrics import RequestRecord, RunResult
from .monitor import ResourceSampler, run_counters


ABORTED = ("abort", "error")  # finish reasons of a request the server ended without completing it (vLLM, SGLang)


def base_url(url: str) -> str:
    """The server's root from --url: http(s)://HOST:PORT, with /v1 or the completions endpoint itself (vLLM's
    --base-url plus --endpoint, given as one URL) taken off; a chat endpoint is refused (the bench streams
    /v1/completions: it would POST under the chat route and every request would fail)."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"--url {url!r} is not an http(s) URL", "e.g. --url http://127.0.0.1:8000")
    if url.endswith("/chat/completions"):
        raise ConfigError(f"--url {url} is a chat endpoint; infer bench streams /v1/completions",
                          f"give the server's address: --url {url[:-len('/chat/completions')].removesuffix('/v1')}")
    url = url[:-len("/completions")] if url.endswith("/v1/completions") else url
    return url[:-3] if url.endswith("/v1") else url


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _check_reachable(client, url: str) -> None:
    import httpx
    try:
        await client.get(f"{url}/v1/models", timeout=10.0)
    except httpx.HTTPError as e:
        raise ConfigError(f"cannot reach {url}: {e or type(e).__name__}",
                          "start the server first (infer serve MODEL) or fix --url") from e


def _body(model: str, req: BenchRequest, temperature: float) -> dict:
    prompt = list(req.prompt_token_ids) if req.prompt_token_ids else req.prompt
    body = {"model": req.lora or model, "prompt": prompt,
            "max_tokens": req.output_len, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if req.ignore_eos:
        body["ignore_eos"] = True
    return body


def _apply_chunk(rec: RequestRecord, data: dict, t: float) -> bool:
    """Time-stamp a chunk of the reply; True when it carried text. A choice with no text is a token too (an EOS,
    a special token, text held back mid-character): vLLM times every chunk with a choice, and so do we."""
    choices = [c for c in data.get("choices") or [] if isinstance(c, dict)]
    text = "".join(c.get("text") or "" for c in choices)
    if choices:
        rec.chunk_times.append(t)
        rec.text += text
    for c in choices:
        if c.get("finish_reason"):
            rec.finish_reason = c["finish_reason"]
    usage = data.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        rec.output_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            rec.prompt_tokens = int(usage["prompt_tokens"])
        details = usage.get("prompt_tokens_details")  # vLLM's --enable-prompt-tokens-details (and infer serve's)
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            rec.cached_tokens = int(details["cached_tokens"])
    return bool(text)


async def _embed_one(client, url: str, model: str, req: BenchRequest, rec: RequestRecord, headers: dict) -> None:
    """One POST /v1/embeddings of the request's prompt into `rec` (its error, or its usage's prompt tokens)."""
    prompt = list(req.prompt_token_ids) if req.prompt_token_ids else req.prompt
    resp = await client.post(f"{url}/v1/embeddings", json={"model": req.lora or model, "input": prompt},
                             headers=headers)
    if resp.status_code != 200:
        rec.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
        return
    body = resp.json()
    if not isinstance(body, dict) or len(body.get("data") or []) != 1:
        rec.error = f"the response holds no single embedding: {str(body)[:300]}"
        return
    rec.finish_reason = "stop"
    usage = body.get("usage")
    if isinstance(usage, dict) and usage.get("prompt_tokens") is not None:
        rec.prompt_tokens = int(usage["prompt_tokens"])


async def _stream_one(client, url: str, body: dict, rec: RequestRecord, headers: dict) -> tuple[list[bool], bool]:
    """Stream one request into `rec`; returns, for each chunk time-stamped, whether it carried text, and whether
    the stream ended with `data: [DONE]` (not cut off by the server closing the connection)."""
    texts: list[bool] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode("utf-8", "replace")[:300]
            rec.error = f"HTTP {resp.status_code}: {detail}"
            return texts, False
        async for line in resp.aiter_lines():
            line = line.strip()
            if not line.startswith("data:"):
                continue  # blank separators, comments, event: lines
            payload = line[5:].strip()
            if payload == "[DONE]":
                return texts, True
            data = json.loads(payload)
            if isinstance(data, dict) and data.get("error"):
                rec.error = str(data["error"])
                return texts, False
            n = len(rec.chunk_times)
            had_text = _apply_chunk(rec, data, time.perf_counter())
            texts += [had_text] * (len(rec.chunk_times) - n)
    return texts, False


class _HttpRun:
    def __init__(self, url, model, requests, concurrency, temperature, api_key, tokenizer, bar, pooling=False):
        self.url, self.model, self.requests, self.temperature = url, model, requests, temperature
        self.pooling = pooling
        self.sem = asyncio.Semaphore(concurrency)
        self.headers, self.tokenizer, self.bar = _headers(api_key), tokenizer, bar
        self.done: list[RequestRecord] = []
        self.in_flight = 0
        self.started = 0
        self.end = time.perf_counter()

    async def one(self, client, i: int, delay: float, sampler: ResourceSampler) -> None:
        await asyncio.sleep(delay)
        req = self.requests[i]
        async with self.sem:
            self.in_flight += 1
            self.started += 1
            rec = RequestRecord(i, req.prompt_len, send_time=time.perf_counter(), lora=req.lora)
            texts: list[bool] = []
            ended = False
            try:
                if self.pooling:
                    await _embed_one(client, self.url, self.model, req, rec, self.headers)
                else:
                    texts, ended = await _stream_one(client, self.url, _body(self.model, req, self.temperature),
                                                     rec, self.headers)
            except Exception as e:  # a dropped connection or a bad chunk fails this request only
                rec.error = f"{type(e).__name__}: {e}"
            finally:
                self.in_flight -= 1
        self._finish(rec, texts, ended)
        sampler.sample(self.in_flight)

    def _finish(self, rec: RequestRecord, texts: list[bool] | None = None, ended: bool = True) -> None:
        """Record `rec` as done; `ended`: the stream ended with [DONE] (False: the connection closed first)."""
        rec.end_time = time.perf_counter()
        if self.pooling:  # (a vector, or the error)
            return self._done(rec)
        texts = texts or []
        if rec.chunk_times and not rec.output_tokens:  # no usage: count the text, and a reply has a token at least
            rec.output_tokens = max(1, len(self.tokenizer.encode(rec.text, add_special_tokens=False))
                                    if self.tokenizer is not None else sum(texts))
        if len(rec.chunk_times) > rec.output_tokens and texts and not texts[-1]:
            rec.chunk_times.pop()  # more chunks than tokens: the last, with no text, only said why the request
            # finished (OpenAI sends one such chunk); it was no token
        if rec.error is None and not rec.chunk_times:
            rec.error = "the stream ended without any reply chunk"
        if rec.error is None and not ended and rec.finish_reason is None:  # the server went away mid-reply
            rec.error = ("the stream ended before the reply finished (no finish_reason and no data: [DONE]; "
                         "the server closed the connection)")
        if rec.error is None and rec.finish_reason in ABORTED:  # cut short by the server: not a completed request
            rec.error = f"finished with reason {rec.finish_reason!r}"
        self._done(rec)

    def _done(self, rec: RequestRecord) -> None:
        rec.success = rec.error is None
        self.done.append(rec)
        self.end = rec.end_time
        self.bar.advance()


async def _run_all(run: _HttpRun, offsets: list[float], sampler: ResourceSampler, t0_box: list) -> None:
    import httpx
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        await _check_reachable(client, run.url)
        t0_box.append(time.perf_counter())
        run.end = t0_box[0]
        sampler.start(t0_box[0])
        await asyncio.gather(*(run.one(client, i, off, sampler) for i, off in enumerate(offsets)))


def run_http(url: str, model: str, requests: list[BenchRequest], concurrency: int, request_rate: float = math.inf,
             api_key: str | None = None, seed: int = 0, progress: bool = True, tokenizer=None,
             temperature: float = 0.0, pooling: bool = False) -> RunResult:
    """Drive the server at `url` with at most `concurrency` streams open (`pooling`: embeddings requests); see the
    module docstring.
    Raises ConfigError when the server cannot be reached. Ctrl-C returns what finished, `partial=True`."""
    if concurrency < 1:
        raise InferError(f"--concurrency must be at least 1, got {concurrency}")
    url = base_url(url)
    offsets = arrival_offsets(len(requests), request_rate, seed)
    sampler, t0_box, partial = ResourceSampler(), [], False
    before = server_stats(url, api_key)  # the server's counters so far (a warm-up's, the levels' before this one)
    with Progress(progress, len(requests), f"http c={concurrency}") as bar:
        run = _HttpRun(url, model, requests, concurrency, temperature, api_key, tokenizer, bar, pooling)
        try:
            asyncio.run(_run_all(run, offsets, sampler, t0_box))
        except KeyboardInterrupt:  # asyncio.run cancelled the open streams
            partial = True
            run.end = time.perf_counter()
    t0 = t0_box[0] if t0_box else run.end
    sampler.sample(0, force=True)
    run.done.sort(key=lambda r: r.index)
    _fill_cached(run.done)
    return RunResult("http", concurrency, run.done, duration_s=run.end - t0, num_requests=len(requests),
                     request_rate=request_rate, partial=partial, aborted=run.started - len(run.done),
                     peak_rss_bytes=sampler.peak_rss_bytes, timeline=sampler.timeline, start_time=t0,
                     engine_stats=_run_stats(before, server_stats(url, api_key)), pooling=pooling)


def _fill_cached(records: list[RequestRecord]) -> None:
    """Once any of a level's requests reported its cached prompt tokens (the server sends prompt_tokens_details),
    a completed request that reported none had none cached: vLLM (and infer serve) leave a null
    prompt_tokens_details, a prompt that found nothing cached, out of the streamed usage chunk."""
    if any(r.cached_tokens is not None for r in records):
        for r in records:
            if r.success and r.cached_tokens is None:
                r.cached_tokens = 0


def _run_stats(before: dict, after: dict) -> dict:
    """The server's figures at the end of a run, its cumulative counters also as run_<name>: their growth over the
    run (as an in-process run's), so a level's speculative decoding figures are its own, not the server's since
    it started; none when the server reports no figures."""
    return run_counters(before, after) if after else {}


def reset_prefix_cache(url: str, api_key: str | None = None) -> bool:
    """Ask the server to drop its prefix cache (vLLM's POST /reset_prefix_cache, served with VLLM_SERVER_DEV_MODE=1),
    so a level does not find the prompts of the level before cached; True when it did."""
    import httpx
    try:
        resp = httpx.post(f"{url}/reset_prefix_cache", headers=_headers(api_key), timeout=10.0, trust_env=False)
    except httpx.HTTPError:
        return False
    return resp.status_code == 200


def server_stats(url: str, api_key: str | None = None) -> dict:
    """The server's engine figures from its /health (an infer server's; with --data-parallel, one entry per
    replica under "replicas"), else a vLLM server's prefix cache counters from its /metrics (vllm_prefix_counters);
    empty for servers that report neither."""
    import httpx
    try:
        body = httpx.get(f"{url}/health", headers=_headers(api_key), timeout=5.0, trust_env=False).json()
    except (httpx.HTTPError, ValueError):
        body = None
    engine = body.get("engine") if isinstance(body, dict) else None
    if isinstance(engine, dict) and engine:
        return engine
    try:
        resp = httpx.get(f"{url}/metrics", headers=_headers(api_key), timeout=5.0, trust_env=False)
    except httpx.HTTPError:
        return {}
    return vllm_prefix_counters(resp.text) if resp.status_code == 200 else {}


# vLLM's Prometheus counters of its prefix cache (v1: tokens looked up, tokens found cached), one sample per engine
_VLLM_PREFIX = re.compile(r"^vllm:prefix_cache_(queries|hits)_total(?:\{[^}]*\})?\s+(\S+)", re.M)


def vllm_prefix_counters(text: str) -> dict:
    """prefix_cache_queries and prefix_cache_hits (as an infer engine's stats() names them) from a vLLM server's
    /metrics text, summed over its engines; {} without both (another server, a vLLM without them). With them a
    level's hit rate comes from the server when no request reports its cached tokens (vLLM sends
    usage.prompt_tokens_details only with --enable-prompt-tokens-details, and only for a prompt that found some
    cached): a level of none cached is then told from a server that sends no details (report.run_prefix_cache)."""
    found: dict[str, float] = {}
    for kind, value in _VLLM_PREFIX.findall(text):
        try:
            found[kind] = found.get(kind, 0.0) + float(value)
        except ValueError:
            return {}
    if set(found) != {"queries", "hits"}:
        return {}
    return {"prefix_cache_queries": int(found["queries"]), "prefix_cache_hits": int(found["hits"])}
