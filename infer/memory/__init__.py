"""Memory planning: how much the weights, a step's activations and the KV cache take, and how many KV blocks (so
what max_length at what concurrency) a budget leaves.

Where each part lives, and why (the layers of `tests/test_layers.py`: ... models < lora < memory < engine ...):

- `sizes` (what a step weighs, from the model's config), `checkpoint` (the weights of a checkpoint from its
  safetensors headers, no tensor read), `plan` (the budget, `MemoryPlan`, and `plan_memory`, the engine's sizing at
  start) and `meter` (peak-memory meters) are pure planning and measuring. They sit below the engine, which calls
  `plan_memory` while it sets itself up. `graph_buckets` (the CUDA graphs' buckets and which stream records each)
  is read by both the plan (the graphs' pool) and `engine.cuda_graphs` (the capture). They read the engine's
  options through the `plan.PlanOptions` protocol, which `EngineConfig` satisfies, instead of importing
  `infer.engine.config`: nothing here imports the engine.
- The profile run, which runs a real model step on a `ModelRunner` under these meters (vLLM keeps its
  `profile_run` in the worker), needs the engine, so it is `infer.engine.profile`.
- `infer warmup`'s plan builder (load the model and profile it, or estimate from files) is the command's own:
  `infer.cli.warmup_plan`.
"""
