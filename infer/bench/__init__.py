"""`infer bench`: workloads (datasets), drivers (driver: in-process engine, http_driver: any OpenAI-compatible
server, hf_baseline: transformers generate), vLLM's metrics (metrics) and reports (report, plots).
Nothing is imported here: import the module you need."""
