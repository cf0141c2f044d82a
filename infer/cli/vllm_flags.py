"""vLLM's command-line options that `infer` does not take, and what to do instead: an unknown option that a vLLM user
would type gets this hint in place of click's guesses (`--trust-remote-code` is not a misspelling of anything).
vLLM's spellings with the same meaning are taken as they are (`--enforce-eager`, `--enable-prefix-caching`,
`--dtype half`, serve's `--uvicorn-log-level`), so they are not listed here."""

from __future__ import annotations

from ..models.classifier import CONVERT_CLASSIFY

_LOCAL = ("MODEL is a local folder (infer downloads nothing); fetch the revision first, e.g. `hf download "
          "ID --revision REV --local-dir DIR`, and pass DIR")
_ONE_GPU = ("infer runs each model on one GPU; use --data-parallel N for N replicas (infer run and infer serve), or a "
            "smaller (int4) model")
_TLS = "infer serve speaks plain HTTP; put a TLS-terminating proxy (nginx, Caddy) in front of it"
_NO_REQUEST_LOG = ("infer serve logs no request contents or per-request lines of its own; drop the option "
                   "(--log-level info shows uvicorn's access log)")
_CONFIG_EDIT = ("infer reads the model's config as MODEL's config.json has it: set the field there, in a copy of the "
                "folder (e.g. a 128k context by YaRN: \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": "
                "2.0, \"original_max_position_embeddings\": 65536} and \"max_position_embeddings\": 131072)")
_CHUNKS = ("infer splits a long prefill into steps of at most --max-num-batched-tokens tokens beside the decodes; "
           "lower --max-num-batched-tokens for shorter chunks")

# the --reasoning-parser names (serve/reasoning.py's PARSERS; tests/test_probes_session52_tools.py holds them equal)
_REASONING = ("deepseek_r1 | qwen3 | seed_oss | openai_gptoss | hunyuan_a13b | exaone4 | mistral | olmo3 | ernie45 | "
              "glm45 | apertus | cohere_command | granite | deepseek_v3 | kimi_k2")
VLLM_HINTS = {
    "--tensor-parallel-size": _ONE_GPU,
    "-tp": _ONE_GPU,
    "--pipeline-parallel-size": _ONE_GPU,
    "-pp": _ONE_GPU,
    "--data-parallel-size": "use --data-parallel N (infer run and infer serve): N engine replicas as Ray actors",
    "-dp": "use --data-parallel N (infer run and infer serve): N engine replicas as Ray actors",
    "--data-parallel-backend": "infer's --data-parallel replicas are always Ray actors; drop the option",
    "--data-parallel-address": "use --ray-address HOST:6379 (the Ray cluster's head, after `ray start --head`)",
    "--data-parallel-size-local": "use --data-parallel N with --ray-address HOST:6379: Ray places the N replicas "
                                  "on the cluster's nodes",
    "--distributed-executor-backend": _ONE_GPU,
    "--trust-remote-code": "infer runs its own Llama, Mistral and Qwen code, never a checkpoint's Python; drop the "
                           "option",
    "--tokenizer": "the tokenizer is read from MODEL's folder; copy the tokenizer's files (tokenizer.json, "
                   "tokenizer_config.json) into it",
    "--revision": _LOCAL,
    "--tokenizer-revision": _LOCAL,
    "--code-revision": _LOCAL,
    "--download-dir": _LOCAL,
    "--load-format": "MODEL's safetensors or .bin weights are read as they are; drop the option",
    "--quantization": "the quantization is read from MODEL's config.json (GPTQ int4/int8, AWQ int4, or a float "
                      "model), --quantization awq or gptq included; drop the option (infer quantize makes a GPTQ "
                      "checkpoint)",
    # a longer context by YaRN (SmolLM3-3B's 128k, Qwen3's) or another rope: vLLM overrides the config, infer reads it
    "--convert": CONVERT_CLASSIFY + " (vLLM's --convert embed: --runner pooling)",
    "--hf-overrides": _CONFIG_EDIT[:-1] + "; an LLM reranker such as Qwen3-Reranker: \"architectures\": "
                      "[\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", \"yes\"], "
                      "\"is_original_qwen3_reranker\": true)",
    "--rope-scaling": _CONFIG_EDIT,
    "--rope-theta": _CONFIG_EDIT,
    "--calculate-kv-scales": "infer's fp8 KV cache (--kv-cache-dtype fp8) stores K and V with scale 1.0, vLLM's "
                             "default; drop the option",
    "--model": "MODEL is the command's first argument, e.g. `infer serve ./my-model --port 8000`",
    "--lora-modules": "use --lora NAME=PATH, once per adapter, e.g. --lora sql=./adapters/sql --lora chat=./chat",
    "--generation-config": "infer reads MODEL's generation_config.json for the sampling defaults, as vLLM's "
                           "default (auto) does; drop the option",
    "--disable-log-requests": _NO_REQUEST_LOG,
    "--enable-log-requests": _NO_REQUEST_LOG,
    "--ssl-keyfile": _TLS,
    "--ssl-certfile": _TLS,
    "--ssl-ca-certs": _TLS,
    "--root-path": "infer serve serves its routes under /; a reverse proxy in front can strip a path prefix",
    "--ssl-cert-reqs": _TLS,
    "--ssl-ciphers": _TLS,
    "--enable-ssl-refresh": _TLS,
    # vLLM's other server (frontend) options
    "--uds": "infer serve listens on TCP (--host, --port); a proxy in front (nginx, Caddy) can take the Unix socket",
    "--enable-request-id-headers": "infer serve always sends a request's X-Request-Id header back on its answer, "
                                   "but makes up none for a request that sends none (vLLM's option sends a random "
                                   "one): drop the option, and have the client (or a proxy) send X-Request-Id",
    "--disable-fastapi-docs": "infer serve has no /docs, /redoc or /openapi.json routes; drop the option",
    "--enable-offline-docs": "infer serve has no /docs, /redoc or /openapi.json routes; drop the option",
    "--api-server-count": "infer serve runs one API server process; use --data-parallel N for N engine replicas",
    "--disable-frontend-multiprocessing": "infer serve runs its engine in the server's own process; drop the option",
    "--max-log-len": _NO_REQUEST_LOG,
    "--enable-log-outputs": _NO_REQUEST_LOG,
    "--log-config-file": "infer serve logs to stderr (--log-level sets how much); drop the option",
    "--disable-access-log-for-endpoints": "infer serve's access log is off unless --log-level is info, debug or "
                                          "trace; drop the option",
    "--h11-max-header-count": "infer serve keeps uvicorn's header limits; drop the option (--max-body-size and "
                              "--max-json-depth bound a request's body)",
    "--h11-max-incomplete-event-size": "infer serve keeps uvicorn's header limits; drop the option (--max-body-size "
                                       "and --max-json-depth bound a request's body)",
    "--enable-server-load-tracking": "GET /metrics has infer:num_requests_in_flight (and waiting, running); drop "
                                     "the option",
    "--middleware": "infer serve takes no ASGI middleware; put what it does in a proxy in front",
    "--enable-chunked-prefill": "infer always splits long prefills into steps of --max-num-batched-tokens tokens "
                                "beside the decodes; drop the option",
    "--no-enable-chunked-prefill": "infer always splits long prefills into steps of --max-num-batched-tokens "
                                   "tokens; raise --max-num-batched-tokens for fewer, larger steps",
    "--num-gpu-blocks-override": "infer sizes the KV cache from the memory budget (--gpu-memory-utilization, or "
                                 "--memory-limit on a CPU); `infer warmup` prints the blocks a budget gives (the "
                                 "Python API takes num_kv_blocks=N)",
    "--kv-cache-memory-bytes": "the KV cache gets what the memory budget (--gpu-memory-utilization, or --memory-limit "
                               "on a CPU) leaves after the weights and activations; `infer warmup` prints its bytes "
                               "and blocks",
    "--cpu-offload-gb": "infer holds every weight on the device; run an int4 model (infer quantize) or a smaller one",
    "--swap-space": "infer preempts a sequence by recomputing it, not by swapping its KV to the CPU; drop the option",
    "--preemption-mode": "infer preempts a sequence by recomputing it (vLLM's recompute); drop the option",
    "--long-prefill-token-threshold": _CHUNKS,
    "--max-num-partial-prefills": _CHUNKS,
    "--max-long-partial-prefills": _CHUNKS,
    # vLLM's adapter options that infer has no counterpart of (--enable-lora, --max-loras, --max-lora-rank and
    # --max-cpu-loras it takes as they are)
    "--lora-dtype": "adapter weights are cast to the model's --dtype, as vLLM's default (auto) does; drop the option",
    "--fully-sharded-loras": "infer runs each model on one GPU, so its adapters are not sharded; drop the option",
    "--disable-log-stats": "infer serve logs no periodic stats (GET /metrics has them); drop the option",
    "--disable-uvicorn-access-log": "infer serve's access log is off unless --log-level is info, debug or trace; "
                                    "drop the option",
    # vLLM's chat options (click guessed --chat-template for them)
    "--chat-template-content-format": "infer finds a template's content format as vLLM's default (auto) does: "
                                      "\"openai\" (a list of parts) for one that loops over a message's content, "
                                      "else the text; drop the option",
    "--default-chat-template-kwargs": "send chat_template_kwargs with each request (e.g. {\"enable_thinking\": "
                                      "false}), or fix the default in the template itself (--chat-template FILE)",
    "--response-role": "a chat reply's role is always \"assistant\"; drop the option",
    # vLLM's tool-calling and reasoning options (click guessed --tool-call-parser or --enable-lora for them)
    "--enable-reasoning": f"infer serve splits the reasoning whenever --reasoning-parser is given ({_REASONING}), "
                          "as later vLLM releases do: drop the option",
    "--reasoning-parser-plugin": "infer serve loads no parser plugins (no Python from outside infer): "
                                 f"--reasoning-parser {_REASONING}",
    "--tool-parser-plugin": "infer serve loads no parser plugins (no Python from outside infer): --tool-call-parser "
                            "hermes | llama3_json | pythonic | mistral | qwen3_coder | seed_oss | openai | granite | "
                            "glm45 | olmo3 | ernie45 | phi4_mini_json | deepseek_v3 | deepseek_v31 | kimi_k2 | "
                            "internlm | xlam | hunyuan_a13b | minimax_m2 (and "
                            "vLLM's llama4_json, llama4_pythonic, "
                            "qwen3_xml, granite4, glm47)",
    "--exclude-tools-when-tool-choice-none": "infer serve renders the tools of a tool_choice \"none\" request in "
                                             "the prompt (vLLM's default); to leave them out, send the request "
                                             "without tools",
    "--expand-tools-even-if-tool-choice-none": "infer serve renders the tools of a tool_choice \"none\" request in "
                                               "the prompt already; drop the option",
    "--tool-server": "infer serve takes function tools only, which the client runs (no built-in tool servers, MCP "
                     "or demo); drop the option",
    # `vllm bench serve`'s spellings
    "--max-concurrency": "infer bench's -c/--concurrency N (one level, or a comma-separated list: -c 1,4,16)",
    "--random-input-len": "infer bench's --input-len (the random dataset's prompt tokens)",
    "--random-output-len": "infer bench's --output-len (the random dataset's output tokens)",
    "--dataset-name": "infer bench's --dataset random | liteqwen | jsonl:PATH | sharegpt:PATH (vLLM's custom "
                      "dataset is jsonl:PATH)",
    "--dataset-path": "infer bench's --dataset jsonl:PATH or --dataset sharegpt:PATH",
    "--base-url": "infer bench's --url http://HOST:PORT (it streams /v1/completions)",
    "--backend": "infer bench drives its in-process engine, or a server's streaming /v1/completions with --url",
    "--endpoint": "infer bench drives a server's streaming /v1/completions with --url http://HOST:PORT",
    "--result-dir": "infer bench's -o/--out FOLDER (results.json, results.csv, report.md and plots)",
    "--save-result": "infer bench always writes its report, to -o/--out FOLDER (default ./bench-results/<time>)",
    "--burstiness": "infer bench's --request-rate arrivals are a Poisson process (vLLM's default, burstiness 1.0); "
                    "drop the option",
    "--metric-percentiles": "infer bench reports p90 and p99 (and the median, mean and std) of every latency "
                            "metric in results.json; drop the option",
    "--percentile-metrics": "infer bench reports percentiles of all of ttft, tpot, itl and e2el; drop the option",
    "--result-filename": "infer bench writes results.json (with results.csv, report.md and plots) into -o/--out "
                         "FOLDER: give a folder per run",
    "--append-result": "infer bench writes each run's report into its own -o/--out FOLDER",
    "--sharegpt-output-len": "infer bench's sharegpt requests ask for the length of each conversation's gpt reply "
                             "(vLLM's default); for one length use --dataset random --output-len N, or a jsonl file "
                             "with \"max_new_tokens\" per line",
    "--custom-output-len": "infer bench's --dataset jsonl:PATH (vLLM's custom dataset) takes --output-len N for "
                           "lines without their own \"max_new_tokens\"",
    "--random-prefix-len": "infer bench's random prompts share no prefix; write prompts with a common prefix into a "
                           "jsonl file (--dataset jsonl:PATH)",
    "--num-warmups": "infer bench warms its in-process engine (and the HF baseline) before measuring; against a "
                     "server (--url) run a short bench first; drop the option",
    # `vllm bench latency`'s and `vllm bench throughput`'s spellings
    "--batch-size": "infer batches requests itself (up to --max-num-seqs); to time a batch of N as vllm bench latency "
                    "does: infer bench MODEL -c N --num-prompts N",
    "--num-iters": "infer bench measures --num-prompts requests at each -c level; run it again for another sample",
    "--num-iters-warmup": "infer bench warms its in-process engine (and the HF baseline) before measuring; drop the "
                          "option",
    "--output-json": "infer bench writes results.json (with results.csv, report.md and plots) into -o/--out FOLDER",
    "--disable-tqdm": "infer bench's -q/--quiet hides the progress bars (and the tables)",
    "--ignore-eos": "infer bench's random dataset ignores EOS already; a jsonl line's \"ignore_eos\": true sets it "
                    "per request",
}


# vllm bench's options, and vllm serve's (frontend) ones: their hints name infer bench's and infer serve's options
_BENCH_ONLY = frozenset({"--batch-size", *(k for k, v in VLLM_HINTS.items() if v.startswith("infer bench"))})
_SERVE_ONLY = frozenset({"--enable-server-load-tracking", *(k for k, v in VLLM_HINTS.items()
                                                             if v.startswith("infer serve") or v in (_TLS,
                                                                                                     _NO_REQUEST_LOG))})

_RUN_NO_LOG = "infer run logs no request contents (-o/--output holds every record); drop the option"
# a command's own counterpart of vLLM's option, where the table's hint names another command's (None: the option is
# a request's field there, which request_field_hint explains)
_BY_COMMAND: dict[str, dict[str, str | None]] = {
    "infer run": {
        "--disable-tqdm": "infer run's -q/--quiet turns the progress bar (and the summary) off",
        "--ignore-eos": None,
        "--output-json": "infer run writes one JSON record per line to -o/--output FILE (--output-format openai for "
                         "OpenAI batch records)",
        "--batch-size": "infer run batches the lines itself, up to --max-num-seqs sequences a step",
        "--max-concurrency": "infer run runs up to --max-num-seqs sequences at once (on each of --data-parallel N "
                             "replicas)",
        "--disable-log-stats": "infer run logs no periodic stats (its progress bar shows requests and tokens/s; "
                               "-q/--quiet turns it off); drop the option",
        "--disable-log-requests": _RUN_NO_LOG,
        "--enable-log-requests": _RUN_NO_LOG,
        "--max-log-len": _RUN_NO_LOG,
        "--enable-log-outputs": _RUN_NO_LOG,
        "--model": "MODEL is the command's first argument, e.g. `infer run ./my-model prompts.jsonl -o out.jsonl`",
        "--enable-reasoning": "infer run splits the reasoning of --output-format openai records whenever "
                              f"--reasoning-parser is given ({_REASONING}): drop the option",
    },
    "infer serve": {
        "--disable-tqdm": "infer serve shows no progress bar; drop the option",
        "--ignore-eos": None,
        "--batch-size": "infer serve batches the requests itself, up to --max-num-seqs sequences a step",
        "--max-concurrency": "infer serve runs up to --max-num-seqs sequences at once and queues up to --max-queue "
                             "more",
    },
    "infer bench": {
        "--disable-log-stats": "infer bench logs no periodic stats (its report has them); drop the option",
        "--model": "MODEL is the command's first argument, e.g. `infer bench ./my-model -c 1,4,16`",
    },
    "infer warmup": {
        "--model": "MODEL is the command's first argument, e.g. `infer warmup ./my-model --max-length 4096`",
    },
}


def vllm_hint(option: str | None, command: str | None = None) -> str | None:
    """What to do instead of vLLM's `option` (given as typed, maybe with `=VALUE`) in `command` (`infer run`...;
    None: any), or None when it is not one. `vllm bench`'s and `vllm serve`'s own options typed to another command
    say whose options they are, and a command with its own counterpart (run's -q/--quiet for --disable-tqdm) names
    it."""
    if not option:
        return None
    name = option.split("=", 1)[0]
    own = _BY_COMMAND.get(command or "", {})
    if name in own:
        return own[name]
    hint = VLLM_HINTS.get(name)
    if hint is None or command is None:
        return hint
    if name in _BENCH_ONLY and command != "infer bench":
        return f"that is `vllm bench`'s option: {hint}"
    if name in _SERVE_ONLY and command != "infer serve":
        return f"that is `vllm serve`'s option: {hint}"
    return hint


# a request's sampling fields, typed as options of `infer run` or `infer serve` (click guessed `--chat-template`
# for `--temperature`): they are set per request, in the JSONL line or the HTTP request
_REQUEST_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "stop", "stop_token_ids", "logprobs", "ignore_eos", "min_tokens",
                   "logit_bias", "bad_words", "allowed_token_ids", "skip_special_tokens")


def request_field_hint(command: str, option: str | None) -> str | None:
    """What to do instead of an option of `command` (`infer run`, `infer serve`) that is a request's field, or
    None when it is not one."""
    if not option or command not in ("infer run", "infer serve", "infer bench"):
        return None
    name = option.split("=", 1)[0].lstrip("-").replace("-", "_")
    if command == "infer bench":  # vllm bench serve's sampling options (click guessed --chat-template)
        return ("infer bench runs every request greedy (temperature 0, vllm bench serve's default); drop the option"
                if name in _REQUEST_FIELDS else None)
    run = command == "infer run"
    if name in ("max_tokens", "max_new_tokens", "max_completion_tokens"):
        return ("use --max-new-tokens N: the default for lines without their own \"max_new_tokens\"" if run else
                "the reply's length is a request's max_tokens (16 by default for completions, up to the context "
                "for chat); --max-model-len caps the context")
    if name not in _REQUEST_FIELDS:
        return None
    if run:
        return (f"\"{name}\" is a request's field, set per line of INPUT: e.g. {{\"prompt\": \"...\", \"{name}\": "
                "...} (in an OpenAI batch line, inside its body)")
    return (f"\"{name}\" is a request's field: send it in each request's body (a request that leaves a sampling "
            "field out gets MODEL's generation_config.json value, else OpenAI's default)")
