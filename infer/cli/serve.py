"""`infer serve MODEL`: an OpenAI-compatible HTTP server (completions, chat, models, health, metrics)."""

from __future__ import annotations

import contextlib
import errno
import logging
import signal
import socket
import threading
from typing import Annotated, Optional

import typer

from ..engine.config import EngineConfig, parse_size
from ..errors import ConfigError
from . import options as o
from .banner import start_traits

SERVER = "Server options"


def _server(*names: str, **kw):
    """typer.Option of a server option (under SERVER in --help)."""
    return typer.Option(*names, rich_help_panel=SERVER, **kw)


def url_host(host: str) -> str:
    """The host as a URL writes it: an IPv6 address in brackets (http://[::1]:8000)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _bind(host: str, port: int) -> socket.socket:
    # an IPv6 address as a URL writes it ([::1]): the brackets are the URL's, not the address's
    address = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
    except OSError as e:
        sock.close()
        if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:  # the address, not the port
            hint = "give --host an address of this machine: 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"
        else:
            hint = "pick another --port (0 picks a free one) or stop what uses it"
        raise ConfigError(f"cannot listen on {url_host(address)}:{port}: {e.strerror or e}", hint) from e
    sock.listen(2048)
    return sock


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's, as vLLM's --uvicorn-log-level
VERBOSE = ("info", "debug", "trace")  # the levels that show the access log and infer's own info lines


@o.engine_options()
def serve(
    model: o.Model,
    host: Annotated[str, _server(help="Address to listen on (0.0.0.0 for every interface).")] = "127.0.0.1",
    port: Annotated[int, _server(help="Port to listen on (0: any free port, printed at start).")] = 8000,
    api_key: Annotated[Optional[list[str]], _server(
        metavar="KEY [KEY ...]", show_default=False, help="Require 'Authorization: Bearer KEY' on every route but "
        "/health; several keys (--api-key A B, as vLLM's) are each accepted, e.g. while rotating them. Default: "
        "$INFER_API_KEY, else $VLLM_API_KEY (one key).")] = None,
    max_queue: Annotated[int, _server(
        help="Requests allowed to wait for the engine; more get 503 with Retry-After.")] = 1024,
    served_model_name: Annotated[Optional[list[str]], _server(
        metavar="NAME [NAME ...]", help="Model id of the base model in the API (default: MODEL's name); several ids "
        "(--served-model-name A B, as vLLM's) are each accepted as `model`, the first is the one reported when a "
        "request names none.")] = None,
    shutdown_timeout: Annotated[float, _server(
        help="On SIGTERM, seconds in-flight requests get to finish before they are aborted.")] = 30.0,
    log_level: Annotated[str, _server(
        "--log-level", "--uvicorn-log-level", help="uvicorn log level: critical | error | warning | info | debug | "
        "trace.")] = "warning",
    data_parallel: Annotated[int, _server(
        "--data-parallel", min=1, help="Engine replicas as Ray actors behind this endpoint, one per GPU; needs "
        "infer[ray].")] = 1,
    ray_address: Annotated[Optional[str], _server(
        "--ray-address", callback=o.check_ray_address, help="Join this Ray cluster (HOST:6379 or ray://HOST:10001); "
        "default: a local Ray runtime.")] = None,
    max_replica_restarts: Annotated[int, _server(
        "--max-replica-restarts", min=0, max=1000, help=o.REPLICA_RESTARTS_HELP)] = o.MAX_REPLICA_RESTARTS,
    replica_placement_timeout: Annotated[float, _server(
        "--replica-placement-timeout", help=o.PLACEMENT_HELP, metavar="SECONDS",
        callback=o.check_placement_timeout)] = o.REPLICA_PLACEMENT_TIMEOUT,
    max_body_size: Annotated[str, _server(
        help="Largest request body, e.g. 8MB or 512KB; a larger one gets 413 before it is read.")] = "8MB",
    max_json_depth: Annotated[int, _server(
        min=1, max=10000, help="How deeply a request body may nest arrays and objects; deeper gets 400.")] = 64,
    allow_runtime_lora: Annotated[bool, _server(
        "--allow-runtime-lora", envvar="INFER_ALLOW_RUNTIME_LORA", help="Turn on POST /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter (adapters added and removed while serving; implies --enable-lora).")] = False,
    enable_auto_tool_choice: Annotated[bool, _server(
        "--enable-auto-tool-choice", help="Let chat requests with tools use tool_choice auto (the default): the "
        "model's calls are read out of its text by --tool-call-parser.")] = False,
    tool_call_parser: Annotated[Optional[str], _server(
        "--tool-call-parser", help="The model family's tool-call syntax, with --enable-auto-tool-choice: hermes "
        "(Hermes 2 Pro and later, Qwen2.5, QwQ), llama3_json (Llama 3.1-3.3 JSON tool calling), pythonic (Llama 3.2, "
        "Llama 4: a Python list of calls), mistral ([TOOL_CALLS]: Mistral 7B v0.3, Nemo, Small), qwen3_coder "
        "(Qwen3-Coder: <function=NAME><parameter=KEY>), seed_oss (Seed-OSS: <seed:tool_call>), openai (gpt-oss: "
        "harmony's to=functions.NAME messages), granite (Granite 3.x: <|tool_call|>[...]), glm45 (GLM-4.5 to 4.7: "
        "<arg_key>/<arg_value>), olmo3 (Olmo 3: <function_calls>), ernie45 (ERNIE 4.5: <tool_call>{...}), "
        "phi4_mini_json (Phi-4-mini: functools[...]), deepseek_v3 (DeepSeek-V3, R1: <｜tool▁calls▁begin｜> and a "
        "```json block per call), deepseek_v31 (DeepSeek-V3.1: NAME<｜tool▁sep｜>{...}), kimi_k2 (Kimi-K2: "
        "<|tool_calls_section_begin|>, ids functions.NAME:IDX), internlm (InternLM2/2.5: "
        "<|action_start|><|plugin|>{...}), xlam (xLAM: a JSON list of calls), hunyuan_a13b (Hunyuan-A13B: "
        "<tool_calls>[...]</tool_calls>) or minimax_m2 (MiniMax-M2: <minimax:tool_call><invoke name=...>).")] = None,
    reasoning_parser: Annotated[Optional[str], _server(
        "--reasoning-parser", help="Split a chat reply's <think>...</think> reasoning from its answer, into the "
        "message's `reasoning` field (as vLLM's option): deepseek_r1 (DeepSeek R1 and its distills), qwen3 (Qwen3, "
        "QwQ, SmolLM3; reads chat_template_kwargs enable_thinking), seed_oss (Seed-OSS's "
        "<seed:think>...</seed:think>) or openai_gptoss (gpt-oss: its harmony analysis channel is the reasoning, the "
        "final channel the answer), hunyuan_a13b (Hunyuan's <think>...</think><answer>...</answer>), exaone4 "
        "(EXAONE 4.0: thinks with chat_template_kwargs enable_thinking true), mistral (Magistral's "
        "[THINK]...[/THINK]), olmo3 (Olmo 3 Think), ernie45 (ERNIE 4.5 Thinking: its <response> wrapper left out), "
        "glm45 (GLM-4.5/4.6), apertus (Apertus's <|inner_prefix|>...<|inner_suffix|>), cohere_command (Command A "
        "Reasoning's <|START_THINKING|>...<|END_THINKING|>), granite (Granite 3.x's 'Here is my thought "
        "process:' ... 'Here is my response:'), deepseek_v3 (DeepSeek-V3.1: thinks with chat_template_kwargs "
        "thinking true) or kimi_k2 (Kimi-K2 Thinking: thinks unless thinking is false). Tool calls are read from "
        "the answer only.")] = None,
    trust_request_chat_template: Annotated[bool, _server(
        "--trust-request-chat-template", help="Let a chat request's own chat_template field render its messages (the "
        "template runs on the server: only for clients you trust).")] = False,
    return_tokens_as_token_ids: Annotated[bool, _server(
        "--return-tokens-as-token-ids", help="Logprobs name each token as 'token_id:ID' instead of its text (as vLLM's "
        "option; a request sets it with return_tokens_as_token_ids).")] = False,
    enable_prompt_tokens_details: Annotated[bool, _server(
        "--enable-prompt-tokens-details", envvar="INFER_ENABLE_PROMPT_TOKENS_DETAILS", help="Report "
        "usage.prompt_tokens_details.cached_tokens in completions and chat responses: the prompt tokens found in the "
        "prefix cache (as vLLM's option; null when none were).")] = False,
    allowed_origins: Annotated[str, _server(
        "--allowed-origins", help="CORS: origins a browser page may call from, a JSON list (as vLLM's), e.g. "
        "'[\"http://localhost:3000\"]'.")] = '["*"]',
    allowed_methods: Annotated[str, _server("--allowed-methods", help="CORS: methods allowed, a JSON list.")] = '["*"]',
    allowed_headers: Annotated[str, _server(
        "--allowed-headers", help="CORS: request headers allowed, a JSON list.")] = '["*"]',
    allow_credentials: Annotated[bool, _server(
        "--allow-credentials", help="CORS: let pages send credentials (cookies, Authorization) across "
        "origins.")] = False,
    engine: EngineConfig = None,
) -> None:
    """Serve MODEL over an OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/responses, /v1/models,
    /health, /metrics, vLLM's /tokenize, /detokenize and /version (and, with --allow-runtime-lora,
    /v1/load_lora_adapter and /v1/unload_lora_adapter). A request's `model` picks a --lora adapter by its NAME (the
    base id, or none, runs the base).

    Example: infer serve tiny-llama --port 8000 --lora support=./adapters/support
    """
    if allow_runtime_lora:
        engine.enable_lora = True  # the adapter slots exist from the start, as vLLM's --enable-lora
    api_key = _api_keys(api_key)
    _check_server_options(port, max_queue, shutdown_timeout, log_level, api_key)
    parser = _tool_parser(enable_auto_tool_choice, tool_call_parser)
    thinking = _reasoning_parser(reasoning_parser)
    from ..serve.cors import cors_options
    cors = cors_options(allowed_origins, allowed_methods, allowed_headers, allow_credentials)
    model_ids = o.served_ids(served_model_name, model)
    if not host.strip():  # an empty address binds every interface: never do that by accident (`--host "$UNSET"`)
        raise ConfigError("--host is empty", "give an address: 127.0.0.1 (this machine) or 0.0.0.0 (every interface)")
    from ..serve.body import BodyLimits
    limits = BodyLimits(parse_size(max_body_size, "--max-body-size"), max_json_depth)
    clash = sorted(set(engine.loras) & {*model_ids, str(model)})
    if clash:  # a request's `model` picks the base model first: that adapter could never be used
        raise ConfigError(f"--lora name {clash[0]!r} is the served model's id, so no request could pick the adapter",
                          "give the adapter another NAME, or serve the base under --served-model-name")
    o.check_replica_options(data_parallel, ray_address)
    if getattr(engine, "enable_sleep_mode", False) and (data_parallel > 1 or ray_address):  # (its routes: 400)
        raise ConfigError("--enable-sleep-mode serves one engine, not --data-parallel replicas (nor --ray-address)",
                          "leave one of them out: POST /sleep puts the one engine of the server to sleep")
    if data_parallel > 1:  # before the port is taken: more local replicas than the machine holds
        from ..parallel.runtime import check_local_replicas
        check_local_replicas(data_parallel, ray_address, engine.device)
    sock = _bind(host, port)
    try:
        if data_parallel > 1 or ray_address:
            from .serve_parallel import serve_data_parallel
            return serve_data_parallel(engine, sock, host, model_ids, api_key, max_queue, shutdown_timeout,
                                       log_level, data_parallel, ray_address, limits, allow_runtime_lora, parser,
                                       thinking,
                                       trust_request_chat_template=trust_request_chat_template, cors=cors,
                                       tokens_as_ids=return_tokens_as_token_ids,
                                       prompt_tokens_details=enable_prompt_tokens_details,
                                       max_restarts=max_replica_restarts,
                                       placement_timeout=replica_placement_timeout)
        _serve(engine, sock, host, model_ids, api_key, max_queue, shutdown_timeout, log_level, limits,
               allow_runtime_lora, parser, thinking, trust_request_chat_template=trust_request_chat_template,
               cors=cors, tokens_as_ids=return_tokens_as_token_ids,
               prompt_tokens_details=enable_prompt_tokens_details)
    finally:
        sock.close()


def _api_keys(keys: list[str] | None) -> str | list[str] | None:
    """--api-key's keys (one, as a string, or several, without repeats), or None. Without the option, the variable
    INFER_API_KEY, else VLLM_API_KEY, holds one key, whole (click's envvar would split it at its spaces, each part a
    key of its own)."""
    if not keys:
        import os
        env = os.environ.get("INFER_API_KEY") or os.environ.get("VLLM_API_KEY")  # the first one set, as click's
        keys = [env] if env else []
    keys = list(dict.fromkeys(keys or []))
    return None if not keys else keys[0] if len(keys) == 1 else keys


def _tool_parser(enable: bool, parser: str | None) -> str | None:
    """--enable-auto-tool-choice and --tool-call-parser, which only work together (as in vLLM)."""
    from ..serve.tools import PARSER_ALIASES, PARSERS
    parser = PARSER_ALIASES.get(parser, parser)
    if enable and parser is None:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser",
                          f"name the model family's tool-call syntax: {' | '.join(PARSERS)}")
    if parser is not None and parser not in PARSERS:
        raise ConfigError(f"--tool-call-parser {parser!r} is not available", f"infer reads: {' | '.join(PARSERS)} "
                          f"(and vLLM's {', '.join(f'{a} as {b}' for a, b in PARSER_ALIASES.items())})")
    if parser is not None and not enable:
        raise ConfigError("--tool-call-parser is used by tool_choice auto only, which needs --enable-auto-tool-choice",
                          "add --enable-auto-tool-choice")
    return parser


def _reasoning_parser(parser: str | None) -> str | None:
    """--reasoning-parser: one of the parsers serve/reasoning.py has, by vLLM's names."""
    from ..serve.reasoning import PARSERS
    if parser is not None and parser not in PARSERS:
        raise ConfigError(f"--reasoning-parser {parser!r} is not available", f"infer reads: {' | '.join(PARSERS)}")
    return parser


def _check_server_options(port: int, max_queue: int, shutdown_timeout: float, log_level: str,
                          api_key: str | list[str] | None = None) -> None:
    """The server options the command line cannot range-check itself, checked before anything binds or loads."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} is not a port number", "use 0..65535")
    if max_queue < 1:
        raise ConfigError(f"--max-queue must be at least 1, got {max_queue}", "e.g. --max-queue 256")
    if not shutdown_timeout >= 0:  # NaN too: it made SIGTERM abort every request at once
        raise ConfigError(f"--shutdown-timeout must be >= 0, got {shutdown_timeout}", "seconds, e.g. 30")
    for key in [api_key] if isinstance(api_key, str) else api_key or []:
        _check_api_key(key)
    if log_level not in LOG_LEVELS:
        raise ConfigError(f"--log-level/--uvicorn-log-level {log_level!r} is not one of {' | '.join(LOG_LEVELS)}",
                          "e.g. --log-level info")  # both: either may have given it


def _check_api_key(api_key: str) -> None:
    if not api_key.strip():  # `--api-key "$UNSET"`: no client could authenticate
        raise ConfigError("--api-key is empty", "give a non-empty key (is INFER_API_KEY or the variable you passed "
                                                "set?), or leave --api-key out to serve without one")
    if not all(" " <= c <= "~" or c == "\t" for c in api_key.strip()):
        # a client sends the key in a header: httpx (the openai SDK) cannot encode it, curl's UTF-8 bytes read back
        # as Latin-1, so every request was a 401
        raise ConfigError("--api-key holds a character an HTTP header cannot carry (a non-ASCII letter or a control "
                          "character), so no client could send it", "use ASCII letters, digits and punctuation, "
                                                                    "e.g. the output of `openssl rand -hex 32`")


def _serve(engine_config: EngineConfig, sock: socket.socket, host: str, model_id, api_key: str | list[str] | None,
           max_queue: int | None, shutdown_timeout: float, log_level: str, limits, runtime_lora: bool = False,
           tool_parser: str | None = None, reasoning_parser: str | None = None,
           trust_request_chat_template: bool = False, cors=None, tokens_as_ids: bool = False,
           prompt_tokens_details: bool = False) -> None:
    from ..serve.native import bound_native_caches
    bound_native_caches()  # before any model code runs: the caches read their capacity once
    from ..engine.llm_engine import LLMEngine
    from ..serve.app import Server, create_app
    from ..serve.lifecycle import uvicorn_server
    from ..serve.async_engine import AsyncEngine

    from .entry import terminate_as_interrupt
    with terminate_as_interrupt():  # SIGTERM while the model loads or warms: "terminated", exit 143, as `infer run`
        engine = LLMEngine(engine_config)  # (uvicorn takes the signals over once it serves)
        engine.warm_kernels()
    server = Server(AsyncEngine(engine, max_queue), model_id, api_key=api_key, graceful_timeout=shutdown_timeout,
                    limits=limits, runtime_lora=runtime_lora, tool_parser=tool_parser,
                    reasoning_parser=reasoning_parser, trust_request_chat_template=trust_request_chat_template,
                    cors=cors, tokens_as_ids=tokens_as_ids, prompt_tokens_details=prompt_tokens_details)
    app = create_app(server)
    bound = sock.getsockname()[1]
    names = (", ".join(server.adapters()) or "none") + (" (more can be loaded)" if runtime_lora else "")
    extra = "  sleep mode: on (POST /sleep?level=1 or 2&mode=abort, wait or keep, POST /wake_up, GET /is_sleeping)" \
        if engine_config.enable_sleep_mode else ""  # as vLLM logs it: the routes a client can call are there
    extra += "  pause: POST /pause?mode=abort, wait or keep, POST /resume, GET /is_paused"  # (one engine: always)
    typer.echo(f"infer: serving {server.model_id} ({engine.device.type}, {start_traits(engine)}) on "
               f"http://{url_host(host)}:{bound}  adapters: {names}{extra}", err=True)
    logging.getLogger("infer").setLevel(logging.INFO if log_level in VERBOSE else logging.WARNING)
    uv = uvicorn_server(server, app, shutdown_timeout, log_level=log_level, access_log=log_level in VERBOSE)
    with _quiet_signals():
        uv.run(sockets=[sock])
    server.aengine.shutdown(0)  # already stopped by the app's shutdown unless uvicorn failed to start
    engine.close()
    typer.echo("infer: server stopped", err=True)


@contextlib.contextmanager
def _quiet_signals():
    """uvicorn re-raises SIGTERM/SIGINT to the previous handlers after its graceful shutdown; make those no-ops
    so that a clean stop exits 0 instead of dying by the signal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.signal(s, lambda *_: None) for s in sigs}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
