"""Which Hugging Face architectures infer runs, and the model class for each."""

from __future__ import annotations

import math
import json

from ..errors import UnsupportedModelError

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    # Ministral 3 (text_config of Mistral3ForConditionalGeneration: Ministral-3-3B/8B/14B): Mistral's layers with
    # a query scaled by position (rope_parameters' llama_4_scaling_beta: Attention.q_scaling; named after Llama 4's
    # but not its attention temperature)
    "Ministral3ForCausalLM": "ministral3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Qwen3MoeForCausalLM": "qwen3_moe",  # mixtures of experts (models.moe)
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "GraniteForCausalLM": "granite",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "Glm4ForCausalLM": "glm4",
    "GlmForCausalLM": "glm",
    "SmolLM3ForCausalLM": "smollm3",  # Llama with no rotary on the layers no_rope_layers marks 0 (NoPE)
    "SeedOssForCausalLM": "seed_oss",  # Llama with q/k/v biases (attention_bias) and o's apart (attention_out_bias)
    "Ernie4_5ForCausalLM": "ernie4_5",  # Llama with a rotary of interleaved pairs (GLM-4's), use_bias on every layer
    # Baidu's ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, 300B-A47B): ERNIE 4.5's layers, experts on the layers of
    # moe_layer_start_index..end_index every moe_layer_interval, a float32 router whose moe_statics bias steers the
    # choice, shared experts (models.moe)
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
    "GptOssForCausalLM": "gpt_oss",  # OpenAI's gpt-oss-20b / 120b: a mixture of experts (models.moe)
    # Zhipu's GLM-4.5 and GLM-4.6 (GLM-4.5-Air): a mixture of experts (models.moe) with a sigmoid router of
    # group-limited top k, shared experts and first_k_dense_replace dense layers; half of each head rotated
    "Glm4MoeForCausalLM": "glm4_moe",
    # AllenAI's OLMoE (OLMoE-1B-7B): a mixture of experts (models.moe) with OLMo 2's q and k norms over the whole
    # projections, in Llama's layer of two norms
    "OlmoeForCausalLM": "olmoe",
    # IBM's Granite MoE (granite-3.x-1b-a400m, 3b-a800m): Granite's four scalars, experts on every layer (the hub's
    # input_linear / output_linear stacks), a router whose softmax is over the top k logits
    "GraniteMoeForCausalLM": "granitemoe",
    # IBM's GraniteMoeShared: Granite MoE with a dense shared MLP (shared_mlp) beside the experts on every layer
    "GraniteMoeSharedForCausalLM": "granitemoeshared",
    "CohereForCausalLM": "cohere",
    "Cohere2ForCausalLM": "cohere2",
    "Exaone4ForCausalLM": "exaone4",
    "Starcoder2ForCausalLM": "starcoder2",
    "ArceeForCausalLM": "arcee",  # Arcee's AFM: Llama with an MLP without gate (up, relu², down)
    "NemotronForCausalLM": "nemotron",  # NVIDIA's Nemotron-4 / Minitron: LayerNorm1P, relu² MLP without gate
    # NVIDIA's Nemotron-H (Nemotron-H-8B/47B, NVIDIA-Nemotron-Nano-9B-v2) and Nemotron 3
    # (NVIDIA-Nemotron-3-Nano-30B-A3B): norm-then-mixer blocks of Mamba-2, attention without rope, a relu² MLP
    # without gate or relu² experts (models.nemotron_h)
    "NemotronHForCausalLM": "nemotron_h",
    # TII's Falcon-H1 (Falcon-H1-0.5B/1.5B/3B/7B/34B): every layer attention and a Mamba-2 mixer in parallel, muP
    # multipliers (models.falcon_h1)
    "FalconH1ForCausalLM": "falcon_h1",
    "ApertusForCausalLM": "apertus",  # Swiss AI's Apertus: xIELU MLP without gate, q/k norms
    # Shanghai AI Lab's InternLM3 (internlm3-8b-instruct): Llama's layers (transformers runs it as LlamaForCausalLM),
    # qkv_bias and bias read as attention_bias and mlp_bias (transformers refuses them unequal), head_dim set apart
    "InternLM3ForCausalLM": "internlm3",
    # Kyutai's Helium (helium-1-2b): Llama's layers with a rotary of interleaved pairs, RMSNorms weighting in float32,
    # q/k/v biases from attention_bias and none on o (whose input is hidden_size wide: heads * head_dim must be that)
    "HeliumForCausalLM": "helium",
    # Tencent's Hunyuan dense (Hunyuan-0.5B/1.8B/4B/7B-Instruct): Llama's layers with q and k normed per head after
    # the rotary, a rope of NTK alpha (rope_scaling's "dynamic" with an alpha: a static base, rope.py)
    "HunYuanDenseV1ForCausalLM": "hunyuan_v1_dense",
    # Tencent's Hunyuan MoE (Hunyuan-A13B-Instruct: 80B, 13B active): the dense Hunyuan's attention, on every layer a
    # float32 softmax router whose top k are renormalised, experts of intermediate_size and a shared MLP of that width
    # beside them, added unscaled (models.moe)
    "HunYuanMoEV1ForCausalLM": "hunyuan_v1_moe",
    # IBM's Granite SWA (granite-swash): Granite's layers with sliding windows on the layers layer_types names, a
    # learned attention sink per head (gpt-oss's) and no rotary on the layers layer_rope_theta gives 0 (NoPE)
    "GraniteSWAForCausalLM": "granite_swa",
    # Qwen3.5's text model: Gated DeltaNet (linear attention) layers and gated attention layers (models.qwen3_5), a
    # state per sequence beside the paged KV
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    # Qwen3-Next (Qwen3-Next-80B-A3B): Qwen3.5's hybrid layers (its in_proj_qkvz and in_proj_ba stored fused, by key
    # head) with Qwen2-MoE's experts and gated shared expert (models.moe)
    "Qwen3NextForCausalLM": "qwen3_next",
    # Qwen3.5 MoE's text model (Qwen3.5-35B-A3B, 397B-A17B): Qwen3.5's hybrid layers (in_proj_qkv, in_proj_z apart)
    # with Qwen3-Next's experts and gated shared expert on every layer (models.moe)
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    # IBM's Granite 4.0 (granite-4.0-micro: attention layers alone; granite-4.0-h-*: Mamba-2 and attention layers with
    # experts): Granite's scalars, a shared MLP on every layer, a Mamba-2 state per sequence (models.granite4)
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    # DeepSeek-V3 (DeepSeek-V3/V3.1/R1, Moonlight-16B-A3B, Kimi-K2): multi-head latent attention served over a latent
    # KV cache of one row a token (models.deepseek), GLM-4.5's router and layout of the experts (models.moe)
    "DeepseekV3ForCausalLM": "deepseek_v3",
    # DeepSeek-V2 (DeepSeek-V2-Lite, V2, V2.5): the same attention, a softmax router of greedy or group-limited top k
    "DeepseekV2ForCausalLM": "deepseek_v2",
    # Zhipu's GLM-4.7-Flash (Glm4MoeLiteForCausalLM): DeepSeek-V3's attention (models.deepseek) with GLM-4.5's
    # router and experts on the layers mlp_layer_types names "sparse"
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
    # rednote's dots.llm1 (dots.llm1.base / inst, 142B-A14B): Qwen3's attention (q and k normed per head, sliding
    # windows on the layers layer_types names) with DeepSeek-V3's router and layout of the experts (models.moe)
    "Dots1ForCausalLM": "dots1",
    # MiniMax's MiniMax-M2 and M2.1 (230B-A10B): Mixtral's layer of experts on every layer with a sigmoid router whose
    # e_score_correction_bias steers the choice, q and k normed over their whole projections, a partial rotary
    # (rotary_dim) (models.moe)
    "MiniMaxM2ForCausalLM": "minimax_m2",
    # Liquid AI's LFM2 (LFM2-350M/700M/1.2B/2.6B): short-conv and attention layers (models.lfm2), a conv state per
    # sequence beside the paged KV
    "Lfm2ForCausalLM": "lfm2",
    # LFM2-MoE (LFM2-8B-A1B): LFM2's layers, experts in the MLPs after the first num_dense_layers (models.moe: a
    # sigmoid router whose expert_bias steers the choice)
    "Lfm2MoeForCausalLM": "lfm2_moe",
    # Meta's Llama 4 text model (Llama-4-Scout-17B-16E, Maverick-17B-128E: the language model of
    # Llama4ForConditionalGeneration, models.multimodal): NoPE layers, a chunked attention and L2-normed q and k on the
    # rope layers, experts whose router scales their input and a shared expert (models.llama4)
    "Llama4ForCausalLM": "llama4_text",
    # Microsoft's Phi-3.5-MoE (Phi-3.5-MoE-instruct: 42B, 6.6B active): LayerNorms with biases, q/k/v/o biases
    # (attention_bias), a head bias (lm_head_bias), Phi-3's longrope (its short_mscale scaling cos and sin), 16
    # experts on every layer routed by the sparsemixer (2 a token) (models.moe)
    "PhimoeForCausalLM": "phimoe",
    # AllenAI's FlexOlmo (FlexOlmo-7x7B-1T): OLMo 2's layers (norms after the attention and the MLP, q and k normed
    # over their whole projections) with OLMoE's experts on every layer (models.moe)
    "FlexOlmoForCausalLM": "flex_olmo",
    # IBM's Bamba (Bamba-9B, Bamba-9B-v2): Granite 4.0's Mamba-2 mixers and attention layers (attn_layer_indices, half
    # of each head rotated) in Llama's layer of two norms with a SwiGLU feed_forward, no Granite scalars
    # (models.bamba), a Mamba-2 state per sequence beside the paged KV
    "BambaForCausalLM": "bamba",
}
LFM2 = ("lfm2", "lfm2_moe")  # (models.lfm2)
# the hybrid models of linear-attention and attention layers: a state cache per sequence (models.qwen3_5); Granite
# 4.0's where its layer_types has a "linear_attention" (Mamba-2) layer (is_hybrid)
HYBRID = ("qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "granitemoehybrid")
# the Granite families: Granite's four scalars (embedding, residual and attention multipliers, logits scaling)
GRANITE = ("granite", "granite_swa", "granitemoe", "granitemoeshared", "granitemoehybrid")
GEMMA = ("gemma", "gemma2", "gemma3_text")  # RMSNorm by 1 + w, embeddings scaled by sqrt(hidden_size), a GeGLU MLP
# Gemma 2's layers and Gemma 3's: four norms a layer (the attention's and the MLP's outputs normed before the residual
# adds them), the attention's scale query_pre_attn_scalar ** -0.5, sliding windows per layer (layer_types)
GEMMA_FOUR_NORMS = ("gemma2", "gemma3_text")
# the families whose attention's and MLP's outputs are normed before the residual adds them (the norms after o_proj
# and down_proj add no residual): Gemma 2's and 3's, and OLMo 2's and 3's (those two norms only: no input norms)
OLMO = ("olmo2", "olmo3")  # OLMo 3: OLMo 2's layers, sliding windows on the layers layer_types names
# GLM-4's (GLM-4-0414, GLM-Z1) too: its post_self_attn_layernorm and post_mlp_layernorm
POST_NORMS = (*GEMMA_FOUR_NORMS, *OLMO, "glm4", "exaone4", "flex_olmo")
# the families whose layers norm the attention's and the MLP's outputs only (no input norms): OLMo 2's and 3's, and
# LG's EXAONE 4 (Exaone4ForCausalLM: OLMo 2's layer with q and k normed per head, Llama's RMSNorm, sliding windows on
# the layers layer_types names and no rotary on the others where sliding_window is set)
POST_ONLY = (*OLMO, "exaone4", "flex_olmo")  # (FlexOlmo: OLMo 2's layer with OLMoE's experts, models.moe)
# GLM-4's attention and MLP: q, k and v biases (attention_bias) and none on o, a partial rotary of interleaved pairs,
# gate|up stored as one mlp.gate_up_proj; the first GLM-4 (GlmForCausalLM: glm-4-9b-chat-hf, model_type glm) has
# them in Llama's layer of two norms, GLM-4-0414 (Glm4ForCausalLM) in a layer of four
GLM = ("glm", "glm4")
# the families whose RMSNorm weights the normed row in float32 and rounds once: OLMo 2's and 3's, gpt-oss's, Helium's
FLOAT_NORMS = (*OLMO, "gpt_oss", "helium", "flex_olmo")
# Cohere's Command R and R+ (CohereForCausalLM) and Command R7B and A (Cohere2ForCausalLM): one LayerNorm (no bias)
# a layer whose output both the attention and the MLP read (their outputs added to the residual together), the
# logits scaled by logit_scale, a rotary of interleaved pairs; Command R+'s q and k LayerNorms per head (use_qk_norm);
# Cohere 2's sliding window on 3 layers of 4 (layer_types) and no rotary on the full layers (NoPE)
COHERE = ("cohere", "cohere2")
# the families whose MLP has no gate (models.llama.UngatedMLP: down(act(up(x)))): StarCoder2's (c_fc, gelu, c_proj),
# Arcee's and Nemotron's (up_proj, relu², down_proj), Apertus's (up_proj, xIELU of learned parameters, down_proj)
UNGATED = ("starcoder2", "arcee", "nemotron", "apertus", "nemotron_h")  # (Nemotron-H's MLP layers: models.nemotron_h)
# Tencent's Hunyuan: the dense models and the mixture of experts, one attention (q and k normed after the rotary, the
# rope's NTK alpha: models.llama.HunYuanDenseV1ForCausalLM)
HUNYUAN = ("hunyuan_v1_dense", "hunyuan_v1_moe")
# the activation each ungated family's hidden_act must name (transformers' ACT2FN name) and infer's name for it
UNGATED_ACT = {"starcoder2": ("gelu_pytorch_tanh", "gelu_tanh"), "arcee": ("relu2", "relu2"),
               "nemotron": ("relu2", "relu2"), "apertus": ("xielu", "xielu")}


_GRANITE = ("infer runs IBM Granite's dense models (GraniteForCausalLM, model_type granite: granite-3.x-2b/8b, "
            "granite-3.x-instruct), Granite SWA (GraniteSWAForCausalLM, model_type granite_swa) and Granite MoE "
            "(GraniteMoeForCausalLM, model_type granitemoe: granite-3.x-1b-a400m, 3b-a800m) and GraniteMoeShared "
            "(GraniteMoeSharedForCausalLM): use one of those")
_OLMO = ("infer runs OLMo 2, OLMo 3 and OLMoE (Olmo2ForCausalLM, Olmo3ForCausalLM, OlmoeForCausalLM): use one "
         "of those")
_GLM = ("infer runs GLM-4-0414 and GLM-Z1 (Glm4ForCausalLM, model_type glm4), glm-4-9b-chat-hf (GlmForCausalLM, "
        "model_type glm), GLM-4.5 / 4.6 (Glm4MoeForCausalLM, model_type glm4_moe) and GLM-4.7-Flash "
        "(Glm4MoeLiteForCausalLM, model_type glm4_moe_lite): use one of those")
_ERNIE = ("infer runs ERNIE 4.5's dense models (Ernie4_5ForCausalLM, model_type ernie4_5: ERNIE-4.5-0.3B) and its "
          "text mixtures of experts (Ernie4_5_MoeForCausalLM, model_type ernie4_5_moe: ERNIE-4.5-21B-A3B): use one "
          "of those")
_COHERE = ("infer runs Cohere's dense Command R, R+ (CohereForCausalLM, model_type cohere), R7B and A "
           "(Cohere2ForCausalLM, model_type cohere2): use one of those")
_EXAONE = "infer runs LG's EXAONE 4.0 (Exaone4ForCausalLM, model_type exaone4): use an EXAONE 4.0 checkpoint"
_STARCODER = ("infer runs BigCode's StarCoder2 (Starcoder2ForCausalLM, model_type starcoder2): use a StarCoder2 "
              "checkpoint")
_ARCEE = "infer runs Arcee's dense AFM (ArceeForCausalLM, model_type arcee: AFM-4.5B): use an AFM checkpoint"
_NEMOTRON = ("infer runs NVIDIA's dense Nemotron-4 and Minitron (NemotronForCausalLM, model_type nemotron) and "
             "Nemotron-H's and Nemotron 3's text models (NemotronHForCausalLM, model_type nemotron_h): use one of "
             "those")
_APERTUS = "infer runs Swiss AI's Apertus text models (ApertusForCausalLM, model_type apertus: Apertus-8B, 70B)"
_INTERNLM = ("infer runs InternLM3 (InternLM3ForCausalLM, model_type internlm3: internlm3-8b-instruct): use an "
             "InternLM3 checkpoint")
_HELIUM = "infer runs Kyutai's Helium (HeliumForCausalLM, model_type helium: helium-1-2b): use a Helium checkpoint"
_HUNYUAN = ("infer runs Tencent's dense Hunyuan (HunYuanDenseV1ForCausalLM, model_type hunyuan_v1_dense: "
            "Hunyuan-0.5B/1.8B/4B/7B-Instruct) and Hunyuan MoE (HunYuanMoEV1ForCausalLM, model_type hunyuan_v1_moe: "
            "Hunyuan-A13B-Instruct): use one of those")
_LFM2 = ("infer runs Liquid AI's LFM2 text models (Lfm2ForCausalLM, model_type lfm2: LFM2-350M, 700M, 1.2B, 2.6B) "
         "and LFM2-MoE (Lfm2MoeForCausalLM, model_type lfm2_moe: LFM2-8B-A1B): use one of those")
_DEEPSEEK = ("infer runs DeepSeek-V3's layout (DeepseekV3ForCausalLM, model_type deepseek_v3: DeepSeek-V3, V3.1, R1, "
             "Moonlight-16B-A3B, Kimi-K2) and DeepSeek-V2's (DeepseekV2ForCausalLM, model_type deepseek_v2: "
             "DeepSeek-V2-Lite, V2, V2.5): use one of those")
_MINIMAX = ("infer runs MiniMax-M2 and M2.1 (MiniMaxM2ForCausalLM, model_type minimax_m2): use one of those")
# the models of the new families' names that infer does not run, by model_type: (what it is, what infer runs)
NEAR_FAMILIES = {
    "deepseek_v32": ("DeepSeek-V3.2 (DeepseekV32ForCausalLM), whose DeepSeek Sparse Attention (a lightning indexer "
                     "choosing each query's keys) infer does not compute", _DEEPSEEK),
    "deepseek_v4": ("DeepSeek-V4 (model_type deepseek_v4), an attention and layout infer does not compute",
                    _DEEPSEEK),
    "deepseek_vl_v2": ("DeepSeek-VL2, a vision-language model (remote code)", _DEEPSEEK),
    "deepseek": ("the first DeepSeek MoE (DeepseekForCausalLM: deepseek-moe-16b, remote code of another layout)",
                 _DEEPSEEK),
    "granitemoe_swa": ("Granite's mixture of experts with sliding-window layers (GraniteMoeSwa)", _GRANITE),
    "olmo": ("the first OLMo (OlmoForCausalLM: OLMo-1B/7B, OLMo-7B-0424), whose LayerNorms have no weights "
             "(and optional clipping of q, k and v: clip_qkv)", _OLMO),
    "olmo_hybrid": ("OLMo's hybrid of linear-attention and attention layers (model_type olmo_hybrid)", _OLMO),
    "ernie4_5_vl_moe": ("ERNIE 4.5's vision-language mixture of experts (Ernie4_5_VLMoeForConditionalGeneration)",
                        _ERNIE),
    "ernie": ("the first ERNIE (ErnieModel: ERNIE 1.0 to 3.0), a BERT-style encoder, not a causal language model",
              _ERNIE),
    "cohere2_vision": ("Command A Vision, Cohere 2's multimodal model (Cohere2VisionForConditionalGeneration)",
                       _COHERE),
    "cohere2_moe": ("Cohere 2's mixture of experts (Cohere2MoeForCausalLM)", _COHERE),
    "cohere_compass": ("Cohere Compass, an embedding model (model_type cohere_compass)", _COHERE),
    "exaone": ("EXAONE 3 and 3.5 (ExaoneForCausalLM, model_type exaone: their own code, another layout)", _EXAONE),
    "exaone_moe": ("EXAONE's mixture of experts (K-EXAONE: model_type exaone_moe)", _EXAONE),
    "exaone4_5": ("EXAONE 4.5, a vision-language model (model_type exaone4_5)", _EXAONE),
    "gpt_bigcode": ("the first StarCoder and SantaCoder (GPTBigCodeForCausalLM: multi-query attention, learned "
                    "position embeddings)", _STARCODER),
    "afmoe": ("Arcee's Trinity, a mixture of experts (AfmoeForCausalLM)", _ARCEE),
    "nemotron-nas": ("Llama-Nemotron's neural-architecture-searched layers (DeciLMForCausalLM: Llama-3.1-Nemotron "
                     "Nano/Super/Ultra), layers of differing shapes", _NEMOTRON),
    "nemotron_h_omni": ("Nemotron-H's multimodal model (model_type nemotron_h_omni)", _NEMOTRON),
    "apertus1p5": ("Apertus 1.5's multimodal model (a vision tower and a language model)",
                   _APERTUS + ": use an Apertus text checkpoint"),
    "apertus1p5_text": ("Apertus 1.5's language model (model_type apertus1p5_text: its own layout)",
                        _APERTUS + ": use one of those"),
    "internlm2": ("InternLM2 and InternLM2.5 (InternLM2ForCausalLM: remote code with q|k|v stored as one wqkv of "
                  "interleaved groups, another layout)", _INTERNLM),
    "internlm": ("the first InternLM (InternLMForCausalLM: remote code, internlm-7b/20b)", _INTERNLM),
    "internlm_xcomposer2": ("InternLM-XComposer2, a vision-language model (remote code)", _INTERNLM),
    "moshi": ("Kyutai's Moshi, a speech-text model (MoshiForConditionalGeneration) on a Helium backbone", _HELIUM),
    "kyutai_speech_to_text": ("Kyutai's speech-to-text model (KyutaiSpeechToTextForConditionalGeneration)", _HELIUM),
    "hunyuan": ("Hunyuan-Large, a mixture of experts with cross-layer attention (remote code)", _HUNYUAN),
    "hunyuan_vl": ("Hunyuan's vision-language model (HunYuanVLForConditionalGeneration)", _HUNYUAN),
    "aya_vision": ("Aya Vision, Cohere's multimodal model (AyaVisionForConditionalGeneration)", _COHERE),
    "minimax": ("MiniMax-Text-01 (MiniMaxForCausalLM), a hybrid of lightning (linear) attention and full attention "
                "layers", _MINIMAX),
    "lfm2_vl": ("LFM2-VL, LFM2's vision-language model (Lfm2VlForConditionalGeneration: a SigLIP2 tower and a "
                "projector before its LFM2 text model)", _LFM2 + " (LFM2-VL's text model is not served on its own)"),
    "lfm3": ("LFM3 (model_type lfm3), whose sliding-window layers, sandwich norms and gated attention infer does not "
             "compute", _LFM2),
}


def check_supported(cfg) -> str:
    from .classifier import causal_name  # (a ForSequenceClassification model: its family's decoder, models.classifier)
    from .multimodal import wrapper_of
    archs = list(getattr(cfg, "architectures", None) or [])
    model_type = getattr(cfg, "model_type", None)
    arch = next((causal_name(a) for a in archs if causal_name(a) in SUPPORTED), None)
    if arch is None and model_type in SUPPORTED.values() and not archs:
        arch = next(a for a, t in SUPPORTED.items() if t == model_type)
    if wrapper_of(cfg) is not None:  # (models.loader.load_config reads its text_config: models.multimodal)
        raise UnsupportedModelError(f"{archs or model_type!r} (model_type {model_type!r}) is a multimodal model's "
                                    "config: infer runs its text model, read from text_config",
                                    "load the folder with infer (models.loader.load_config), not its config alone")
    if model_type == "ministral" and "MistralForCausalLM" in map(causal_name, archs):
        raise UnsupportedModelError(
            "config.json of a MistralForCausalLM has layer_types, which makes transformers run it as Ministral "
            "(sliding attention on some layers only), an architecture infer does not run",
            "if every layer slides over sliding_window (Mistral), remove layer_types from config.json")
    check_near_family(model_type, archs)
    if arch is None or model_type not in SUPPORTED.values():
        raise UnsupportedModelError(
            f"unsupported architecture {archs or model_type!r} (model_type {model_type!r})",
            f"infer runs {', '.join(SUPPORTED)}")
    check_activation(cfg)
    if model_type in GEMMA:
        check_gemma(cfg)
    if model_type in COHERE:
        check_cohere(cfg)
    if model_type == "helium":
        check_helium(cfg)
    if model_type in HUNYUAN:
        check_hunyuan(cfg)
    if model_type == "llama4_text":
        check_llama4(cfg)
    if model_type == "minimax_m2":
        check_minimax_m2(cfg)
    if model_type == "granite_swa":
        check_granite_swa(cfg)
    if model_type == "glm4_moe_lite":
        check_glm4_moe_lite(cfg)
    if model_type == "granitemoehybrid":
        check_granite4(cfg)
    elif model_type == "nemotron_h":
        check_nemotron_h(cfg)
    elif model_type == "bamba":
        check_bamba(cfg)
    elif model_type in LFM2:
        check_lfm2(cfg)
    elif model_type == "falcon_h1":
        check_falcon_h1(cfg)
    elif model_type in HYBRID:  # (the Gated DeltaNet layers of Qwen3.5, Qwen3.5 MoE and Qwen3-Next)
        check_linear_attention(cfg)
    from .moe import check_moe
    check_moe(cfg)
    return arch


def check_near_family(model_type, archs) -> None:
    """Refuse a neighbour of a supported family that infer does not run (NEAR_FAMILIES), naming what it is; also
    before transformers reads its config.json (models.loader: some, such as Llama-Nemotron's nemotron-nas, are remote
    code that transformers does not know)."""
    if model_type in NEAR_FAMILIES:  # (their architectures share a name with a supported family's)
        what, hint = NEAR_FAMILIES[model_type]
        raise UnsupportedModelError(f"{archs or model_type!r} (model_type {model_type!r}) is {what}, which infer "
                                    "does not run", hint)


def activation(cfg) -> str:
    """The MLP's activation as infer computes it: "silu" (the Llama family), or "gelu_tanh" (Gemma's GeGLU:
    transformers' gelu_pytorch_tanh, which Gemma reads from hidden_act and Gemma 2 and 3 from hidden_activation;
    StarCoder2's MLP without gate), "relu2" (relu(x)², Arcee's and Nemotron's) or "xielu" (Apertus's);
    anything else is an UnsupportedModelError naming the field."""
    model_type = getattr(cfg, "model_type", None)
    if model_type == "nemotron_h":  # (its MLP: up, relu², down; the Mamba-2 mixers' silu: mamba_hidden_act)
        for field, name in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if getattr(cfg, field, name) != name:
                raise UnsupportedModelError(f"{field} {getattr(cfg, field)!r} is not supported for nemotron_h",
                                            f"Nemotron-H's {field} is {name}, the only one infer computes for it")
        return "relu2"
    if model_type in UNGATED:  # (an MLP without gate: up, the activation, down; StarCoder2's c_fc, c_proj)
        name, ours = UNGATED_ACT[model_type]
        act = getattr(cfg, "hidden_act", None) or name
        if act != name:
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported for {model_type}",
                                        f"{model_type}'s MLP uses {name}, the only activation infer computes for it")
        return ours
    if model_type in GEMMA:
        field = "hidden_act" if model_type == "gemma" else "hidden_activation"
        act = getattr(cfg, field, None) or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":  # (GemmaConfig reads a legacy "gelu" as this one)
            raise UnsupportedModelError(f"{field} {act!r} is not supported for {model_type}",
                                        "Gemma's MLP uses gelu_pytorch_tanh (gelu's tanh approximation)")
        return "gelu_tanh"
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' ACT2FN maps both to SiLU
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported", "the Llama family uses silu")
    return "silu"


def check_activation(cfg) -> None:
    activation(cfg)


def check_gemma(cfg) -> None:
    """What a Gemma config may ask that infer's attention cannot do, refused up front: bidirectional attention
    (use_bidirectional_attention: an encoder such as EmbeddingGemma, not a causal LM)."""
    if getattr(cfg, "use_bidirectional_attention", None):
        raise UnsupportedModelError(f"{cfg.model_type} with use_bidirectional_attention (every token attending to "
                                    "the tokens after it too) is not supported: infer's attention is causal",
                                    "infer runs Gemma causal language models (use_bidirectional_attention unset)")


def check_cohere(cfg) -> None:
    """What a Cohere config may ask that infer cannot do, refused up front: a logit_scale that is no finite number
    (null: the model's logits times None, a TypeError when it was built), Cohere 2 layers of a type other than
    sliding_attention and full_attention."""
    scale = getattr(cfg, "logit_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise UnsupportedModelError(f"config.json's logit_scale {scale!r} is not a number",
                                    "Cohere's logits are multiplied by logit_scale (0.0625 in Command R's config.json):"
                                    " give it as a number, or use the config.json that came with the weights")
    if cfg.model_type == "cohere2":
        other = sorted({t for t in (getattr(cfg, "layer_types", None) or [])
                        if t not in ("sliding_attention", "full_attention")})
        if other:
            raise UnsupportedModelError(f"cohere2 layer_types {other} are not supported",
                                        "Cohere 2's layers are sliding_attention or full_attention")


def check_helium(cfg) -> None:
    """Helium's o projection reads hidden_size columns (transformers' HeliumAttention): heads * head_dim of another
    width is refused up front (transformers fails loading such weights)."""
    from .shapes import ModelShapes
    shapes = ModelShapes.from_config(cfg)
    if shapes.q_size != cfg.hidden_size:
        raise UnsupportedModelError(f"helium with num_attention_heads * head_dim ({shapes.num_heads} * "
                                    f"{shapes.head_dim} = {shapes.q_size}) other than hidden_size ({cfg.hidden_size}) "
                                    "is not supported", "Helium's o_proj is hidden_size by hidden_size: set head_dim "
                                    "to hidden_size / num_attention_heads (use the config.json that came with the "
                                    "weights)")


# Hunyuan's remote-code fields that transformers' HunYuanDenseV1 and HunYuanMoEV1 never read (they norm q and k, rotate
# every layer, share no KV across layers, project q, k and v as usual and add the MoE's shared MLP, whatever these say):
# (field, the value their layers assume, what another value means)
_HUNYUAN_FIXED = (("use_qk_norm", True, "q and k not normed"), ("use_rotary_pos_emb", True, "no rotary"),
                  ("use_cla", False, "cross-layer attention (layers sharing keys and values)"),
                  ("use_mla", False, "multi-head latent attention"))
_HUNYUAN_MOE_FIXED = (("use_mixed_mlp_moe", True, "no shared MLP beside the experts"),)


def check_hunyuan(cfg) -> None:
    """A Hunyuan config whose remote-code fields ask another layer than transformers' (and infer's) runs: refused
    naming the field (transformers would run the weights as the usual layers); Hunyuan MoE's per-layer fields too
    (`_check_hunyuan_moe`)."""
    t = cfg.model_type
    for field, value, what in _HUNYUAN_FIXED + (_HUNYUAN_MOE_FIXED if t == "hunyuan_v1_moe" else ()):
        got = getattr(cfg, field, None)
        if got is not None and bool(got) != value:
            kind = "dense models" if t == "hunyuan_v1_dense" else "mixtures of experts (Hunyuan-A13B)"
            raise UnsupportedModelError(f"{t} with {field} {json.dumps(got)} ({what}) is not supported",
                                        f"Hunyuan's {kind} have {field} {json.dumps(value)}: use the config.json that "
                                        "came with the weights")
    if t == "hunyuan_v1_moe":
        _check_hunyuan_moe(cfg)


def _per_layer(cfg, field: str) -> list:
    """config.json's `field` as a list of its values (the remote code's int or list, one a layer; [] where unset)."""
    got = getattr(cfg, field, None)
    return [] if got is None else list(got) if isinstance(got, (list, tuple)) else [got]


def _check_hunyuan_moe(cfg) -> None:
    """The remote code's per-layer MoE fields where they ask what transformers' HunYuanMoEV1 (one k, experts and a
    shared MLP of intermediate_size on every layer) does not run: moe_topk differing by layer (or fewer entries than
    layers: transformers fails indexing them), moe_intermediate_size other than intermediate_size, num_shared_expert
    other than 1, moe_layer_num_skipped dense layers first. (capacity_factor, moe_drop_tokens and
    moe_random_routing_dropped_token are training's: transformers and vLLM route every token to its k experts.)"""
    hint = "use the config.json that came with the weights (Hunyuan-A13B's: moe_topk 8 on every layer, " \
           "moe_intermediate_size and intermediate_size 3072, num_shared_expert 1, moe_layer_num_skipped 0)"
    ks, layers = _per_layer(cfg, "moe_topk"), cfg.num_hidden_layers
    if len(set(map(str, ks))) > 1 or (isinstance(cfg.moe_topk, (list, tuple)) and len(ks) < layers):
        raise UnsupportedModelError(f"hunyuan_v1_moe with moe_topk {json.dumps(ks)} for {layers} layers is not "
                                    "supported: infer routes every layer's tokens to one number of experts", hint)
    checks = (("moe_intermediate_size", cfg.intermediate_size, "experts of another width than intermediate_size, "
               "which transformers gives the experts"),
              ("num_shared_expert", 1, "a shared MLP of another width than intermediate_size, transformers'"))
    for field, want, what in checks:
        other = sorted({json.dumps(v) for v in _per_layer(cfg, field) if v != want})
        if other:
            raise UnsupportedModelError(f"hunyuan_v1_moe with {field} {', '.join(other)} ({what}) is not "
                                        "supported", hint)
    skipped = getattr(cfg, "moe_layer_num_skipped", 0) or 0
    if skipped:
        raise UnsupportedModelError(f"hunyuan_v1_moe with moe_layer_num_skipped {json.dumps(skipped)} (its first "
                                    "layers dense) is not supported: transformers and infer give every layer the "
                                    "experts", hint)


# MiniMax-M2's remote-code fields that transformers' MiniMaxM2 never reads (its layers norm q and k over their whole
# projections, route by sigmoid scores and their bias, and have no shared expert, whatever they say): (field, the value
# its layers assume, what another value means)
_MINIMAX_FIXED = (("use_qk_norm", True, "q and k not normed"),
                  ("qk_norm_type", "per_layer", "q and k normed otherwise than over their whole projections"),
                  ("scoring_func", "sigmoid", "the router's scores by another function than sigmoid"),
                  ("use_routing_bias", True, "a router without e_score_correction_bias"),
                  ("shared_intermediate_size", 0, "a shared expert beside the experts"))


def check_minimax_m2(cfg) -> None:
    """A MiniMax-M2 config whose remote-code fields ask another layer than transformers' (and infer's) runs
    (`_MINIMAX_FIXED`), or whose attn_type_list names a layer of linear (lightning) attention (MiniMax-Text-01's:
    0), refused naming the field (transformers would run the weights as its usual layers)."""
    for field, value, what in _MINIMAX_FIXED:
        got = getattr(cfg, field, None)
        if got is not None and got != value:
            raise UnsupportedModelError(f"minimax_m2 with {field} {json.dumps(got)} ({what}) is not supported",
                                        f"MiniMax-M2's layers have {field} {json.dumps(value)}: use the config.json "
                                        "that came with the weights")
    linear = [i for i, kind in enumerate(getattr(cfg, "attn_type_list", None) or []) if kind != 1]
    if linear:
        raise UnsupportedModelError(f"minimax_m2 with attn_type_list naming layers {linear[:8]} of linear attention "
                                    "(not 1) is not supported: MiniMax-M2's layers are all full attention (1)",
                                    "use the config.json that came with the weights (MiniMax-Text-01's hybrid of "
                                    "lightning and full attention is another architecture)")


def check_llama4_temperature_tuning(raw: dict) -> None:
    """config.json's attn_temperature_tuning of a Llama 4 text model (top level, or a multimodal checkpoint's
    text_config) as an integer, refused before transformers reads it: transformers 4.51 defaulted it to 4 and its
    model scaled the NoPE layers' queries for any nonzero value, so configs it saved may say 4; transformers 5's
    Llama4TextConfig takes only true or false (its validation error names neither the model nor the fix). The hub's
    Scout and Maverick configs leave it out (true)."""
    for where, part in (("", raw), ("text_config's ", raw.get("text_config"))):
        if not isinstance(part, dict) or part.get("model_type") != "llama4_text":
            continue
        value = part.get("attn_temperature_tuning")
        if value is not None and type(value) is not bool:
            raise UnsupportedModelError(
                f"config.json's {where}attn_temperature_tuning is {json.dumps(value)[:40]}: Llama 4's attention "
                "temperature switch is true or false (transformers 4.51 wrote 4 for true; transformers 5 reads "
                "only a boolean)", f"set attn_temperature_tuning to {'true' if value else 'false'} in config.json "
                "(transformers 4.51 scaled the NoPE layers' queries for any nonzero value)")


def check_llama4(cfg) -> None:
    """A Llama 4 text config transformers builds layers of that infer's do not run, refused naming the field:
    no_rope_layers or layer_types not one a layer (transformers indexes them by layer), layer_types other than
    full_attention and chunked_attention or chunked where transformers' attention is not (a NoPE layer, or without
    attention_chunk_size), an attention_chunk_size that is not a positive integer, moe_layers naming no layer,
    floor_scale not positive (the temperature's floor divides by it)."""
    hint = "use the config.json that came with the weights"
    layers = cfg.num_hidden_layers
    rope = list(getattr(cfg, "no_rope_layers", None) or [])
    if len(rope) < layers or any(r not in (0, 1) for r in rope):
        raise UnsupportedModelError(f"llama4_text with no_rope_layers {json.dumps(rope)[:80]} for {layers} layers is "
                                    "not supported (a 1 or a 0 a layer: rotary or NoPE)", hint)
    chunk = getattr(cfg, "attention_chunk_size", None)
    if chunk is not None and (type(chunk) is not int or chunk < 1):
        raise UnsupportedModelError(f"llama4_text with attention_chunk_size {json.dumps(chunk)} is not supported (a "
                                    "positive integer, or null: no chunked attention)", hint)
    types = _layer_kinds(cfg, "layer_types", ("full_attention", "chunked_attention"),
                         "Llama 4's layer_types give each of num_hidden_layers layers \"full_attention\" or "
                         "\"chunked_attention\": " + hint)
    odd = [i for i, t in enumerate(types) if (t == "chunked_attention") != bool(rope[i] and chunk)]
    if odd:
        raise UnsupportedModelError(f"llama4_text with layer_types chunked where the rope layers are not (layers "
                                    f"{odd[:8]}) is not supported: infer chunks the attention of the rope layers "
                                    "(no_rope_layers 1) where attention_chunk_size is set, as transformers builds "
                                    "layer_types", "remove layer_types from config.json (transformers derives it), "
                                    "or " + hint)
    bad = [i for i in (getattr(cfg, "moe_layers", None) or []) if type(i) is not int or not 0 <= i < layers]
    if bad:
        raise UnsupportedModelError(f"llama4_text with moe_layers {bad[:8]} naming no layer of {layers} is not "
                                    "supported", hint)
    floor = getattr(cfg, "floor_scale", 1)
    if getattr(cfg, "attn_temperature_tuning", False) and not (type(floor) in (int, float) and floor > 0):
        raise UnsupportedModelError(f"llama4_text with floor_scale {json.dumps(floor)} is not supported (a positive "
                                    "number: the attention temperature's positions are divided by it)", hint)


def check_linear_attention(cfg) -> None:
    """A Gated DeltaNet config (Qwen3.5, Qwen3-Next: models.qwen3_5) its layers cannot run: head counts and sizes
    that are not positive, value heads that are not a multiple of the key heads (each key head serves
    value heads / key heads of them, as transformers' repeat_interleave), a conv kernel under 2 (the conv state
    keeps its last kernel - 1 inputs), layer_types other than linear_attention and full_attention: refused naming
    the field, before the engine starts (they failed its first step with an internal error)."""
    t = cfg.model_type
    fields = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
    for name in fields:
        got = getattr(cfg, name, None)
        if type(got) is not int or got < 1:
            raise UnsupportedModelError(f"{t} with {name} {json.dumps(got)} is not supported (a positive integer)",
                                        "use the config.json that came with the weights")
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if hv % hk:
        raise UnsupportedModelError(f"{t} with linear_num_value_heads {hv} not a multiple of linear_num_key_heads "
                                    f"{hk} is not supported (each key head serves the same number of value heads)",
                                    "use the config.json that came with the weights")
    kernel = getattr(cfg, "linear_conv_kernel_dim", None)
    if type(kernel) is not int or kernel < 2:
        raise UnsupportedModelError(f"{t} with linear_conv_kernel_dim {json.dumps(kernel)} is not supported "
                                    "(a conv kernel of 2 or more)", "use the config.json that came with the weights")
    other = sorted({str(x) for x in (getattr(cfg, "layer_types", None) or [])
                    if x not in ("linear_attention", "full_attention")})
    if other:
        raise UnsupportedModelError(f"{t} layer_types {other} are not supported",
                                    f"{t}'s layers are linear_attention or full_attention")


def _layer_kinds(cfg, field: str, kinds: tuple[str, ...], hint: str) -> list:
    """config.json's `field` (a kind per layer), refused naming it where a kind is not among `kinds` or the list is
    not one a layer (num_hidden_layers)."""
    types = list(getattr(cfg, field, None) or [])
    other = sorted({str(t) for t in types if t not in kinds})
    if other or len(types) != cfg.num_hidden_layers:
        raise UnsupportedModelError(f"{cfg.model_type} {field} {other or types} are not supported"
                                    + ("" if other else f" for {cfg.num_hidden_layers} layers"), hint)
    return types


def check_glm4_moe_lite(cfg) -> None:
    """GLM-4.7-Flash's mlp_layer_types other than "dense" and "sparse" (or not one a layer), and a rotary whose width
    (transformers': head_dim, its config's name of qk_rope_head_dim, times partial_rotary_factor) is not
    qk_rope_head_dim (its attention rotates those dims by it: transformers fails on another): refused naming them."""
    _layer_kinds(cfg, "mlp_layer_types", ("dense", "sparse"), "GLM-4.7-Flash's mlp_layer_types give each of "
                 "num_hidden_layers layers \"dense\" or \"sparse\": use the config.json that came with the weights")
    from .rope import rope_parameters
    factor = rope_parameters(cfg).get("partial_rotary_factor", 1.0)
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if int(head * factor) != cfg.qk_rope_head_dim:
        raise UnsupportedModelError(f"glm4_moe_lite with a rotary of {int(head * factor)} dims (head_dim {head} times "
                                    f"partial_rotary_factor {factor}) over qk_rope_head_dim {cfg.qk_rope_head_dim} is "
                                    "not supported (transformers fails rotating them)",
                                    "remove partial_rotary_factor (GLM-4.7-Flash rotates all qk_rope_head_dim dims): "
                                    "use the config.json that came with the weights")


def check_granite_swa(cfg) -> None:
    """Granite SWA's layer_types other than sliding_attention and full_attention, sliding layers without a
    sliding_window (transformers fails building their mask), and a layer_rope_theta of several non-zero bases
    (transformers builds a rotary per base; infer's layers share one table, of that base: rope.layer_rope_base):
    refused naming them."""
    types = list(getattr(cfg, "layer_types", None) or [])
    other = sorted({str(t) for t in types if t not in ("sliding_attention", "full_attention")})
    if other:
        raise UnsupportedModelError(f"granite_swa layer_types {other} are not supported",
                                    "Granite SWA's layers are sliding_attention or full_attention")
    window = getattr(cfg, "sliding_window", None)
    if "sliding_attention" in types and not (type(window) is int and window > 0):
        raise UnsupportedModelError(f"granite_swa with sliding_attention layers and sliding_window "
                                    f"{json.dumps(window)} is not supported (transformers fails masking them)",
                                    "set sliding_window to the window the weights were trained with (Granite SWA's "
                                    "default: 128), or name those layers full_attention in layer_types")
    from .rope import rope_parameters
    base = rope_parameters(cfg).get("rope_theta")
    bases = {t for t in (getattr(cfg, "layer_rope_theta", None) or []) if type(t) in (int, float) and t != 0}
    thetas = sorted(bases - {base}, key=str)
    if len(bases) > 1:
        raise UnsupportedModelError(f"granite_swa layer_rope_theta with bases {thetas} other than rope_theta {base} "
                                    "is not supported", "infer's Granite SWA layers share one rope table: give every "
                                    "rotating layer one base in layer_rope_theta (0 where a layer has no rotary)")


def check_granite4(cfg) -> None:
    """Granite 4.0's layer_types other than Mamba-2 (linear_attention, config.json's "mamba") and attention
    (full_attention, "attention") or without an attention layer, a position_embedding_type other than rope and
    none, and Mamba-2 heads that its groups do not divide (transformers fails on them): refused naming them
    (models.granite4)."""
    types = _layer_kinds(cfg, "layer_types", ("linear_attention", "full_attention"),
                         "Granite 4.0's layer_types give each of num_hidden_layers layers \"mamba\" or \"attention\": "
                         "use the config.json that came with the weights")
    if types and "full_attention" not in types:  # (transformers' default layer_types: every layer Mamba-2)
        raise UnsupportedModelError("granitemoehybrid with no attention layer (every layer_types entry \"mamba\") is "
                                    "not supported: infer's KV blocks, which count each sequence's tokens, are an "
                                    "attention layer's",
                                    "serve a Granite 4.0 checkpoint with attention layers (granite-4.0-h-*, "
                                    "granite-4.0-micro)")
    kind = getattr(cfg, "position_embedding_type", None)
    if kind not in (None, "rope", "nope"):
        raise UnsupportedModelError(f"granitemoehybrid position_embedding_type {json.dumps(kind)} is not supported",
                                    "Granite 4.0's attention rotates by rope (\"rope\") or by none (\"nope\", null)")
    heads, groups = getattr(cfg, "mamba_n_heads", 1), getattr(cfg, "mamba_n_groups", 1)
    if "linear_attention" in types and (not groups or heads % groups):
        raise UnsupportedModelError(f"granitemoehybrid with mamba_n_heads {heads} in mamba_n_groups {groups} is not "
                                    "supported: each group's B and C serve mamba_n_heads / mamba_n_groups heads",
                                    "use the config.json that came with the weights")


def check_nemotron_h(cfg) -> None:
    """Nemotron-H's layers_block_type (hybrid_override_pattern) without an attention layer, and Mamba-2 heads that
    its groups do not divide: refused naming them (models.nemotron_h; its experts, "E", moe: Nemotron 3's, checked
    by models.moe.check_moe)."""
    types = list(getattr(cfg, "layers_block_type", None) or [])
    if "full_attention" not in types:
        raise UnsupportedModelError("nemotron_h with no attention layer (no \"*\" in hybrid_override_pattern) is "
                                    "not supported: infer's KV blocks, which count each sequence's tokens, are an "
                                    "attention layer's", "serve a Nemotron-H checkpoint with attention layers")
    heads, groups = getattr(cfg, "mamba_num_heads", 1), getattr(cfg, "n_groups", 1)
    if "linear_attention" in types and (not groups or heads % groups):
        raise UnsupportedModelError(f"nemotron_h with mamba_num_heads {heads} in n_groups {groups} is not supported: "
                                    "each group's B and C serve mamba_num_heads / n_groups heads",
                                    "use the config.json that came with the weights")


def check_bamba(cfg) -> None:
    """Bamba's attn_layer_indices naming no layer (transformers then builds every layer Mamba-2) or none at all, an
    attn_rotary_emb other than the rotary transformers computes (half of each head: BambaConfig's partial_rotary_factor
    0.5, whatever config.json says), and Mamba-2 heads that its groups do not divide or whose mamba_d_head
    does not tile mamba_expand * hidden_size (transformers fails on them): refused naming them (models.bamba)."""
    hint = "use the config.json that came with the weights"
    layers = int(cfg.num_hidden_layers)
    indices = list(getattr(cfg, "attn_layer_indices", None) or [])
    bad = [i for i in indices if type(i) is not int or not 0 <= i < layers]
    if bad:
        raise UnsupportedModelError(f"bamba with attn_layer_indices {bad[:8]} naming no layer of {layers} is not "
                                    "supported", hint)
    if not indices:
        raise UnsupportedModelError("bamba with no attention layer (attn_layer_indices empty: every layer Mamba-2) is "
                                    "not supported: infer's KV blocks, which count each sequence's tokens, are an "
                                    "attention layer's", "serve a Bamba checkpoint with attention layers (Bamba-9B's: "
                                    "attn_layer_indices [9, 18, 27])")
    from .rope import rope_parameters
    from .shapes import ModelShapes
    head = ModelShapes.from_config(cfg).head_dim
    width = int(head * rope_parameters(cfg).get("partial_rotary_factor", 1.0))
    rotary = getattr(cfg, "attn_rotary_emb", None)
    if rotary is not None and rotary != width:
        raise UnsupportedModelError(f"bamba with attn_rotary_emb {json.dumps(rotary)} is not supported: transformers "
                                    f"rotates {width} dims of each head of {head} (partial_rotary_factor 0.5), "
                                    "whatever attn_rotary_emb says", f"set attn_rotary_emb to {width} (or remove it) "
                                    "if the weights were trained rotating half of each head; else " + hint)
    heads, groups = getattr(cfg, "mamba_n_heads", 1), getattr(cfg, "mamba_n_groups", 1)
    if not groups or heads % groups:
        raise UnsupportedModelError(f"bamba with mamba_n_heads {heads} in mamba_n_groups {groups} is not supported: "
                                    "each group's B and C serve mamba_n_heads / mamba_n_groups heads", hint)
    inter = cfg.mamba_expand * cfg.hidden_size
    if cfg.mamba_d_head * heads != inter:
        raise UnsupportedModelError(f"bamba with mamba_d_head {cfg.mamba_d_head} times mamba_n_heads {heads} other "
                                    f"than mamba_expand * hidden_size ({inter}) is not supported (the mixer's heads "
                                    "tile its intermediate width)", hint)


def check_lfm2(cfg) -> None:
    """LFM2's (and LFM2-MoE's) layer_types other than "conv" and "full_attention" (or not one a layer), none of them
    attention, and a conv of under 2 taps (conv_L_cache: its state keeps the last conv_L_cache - 1 inputs): refused
    naming them (models.lfm2)."""
    types = _layer_kinds(cfg, "layer_types", ("conv", "full_attention"),
                         "LFM2's layer_types give each of num_hidden_layers layers \"conv\" or \"full_attention\": "
                         "use the config.json that came with the weights")
    if "full_attention" not in types:
        raise UnsupportedModelError(f"{cfg.model_type} with no attention layer (every layer_types entry \"conv\") "
                                    "is not supported: infer's KV blocks, which count each sequence's tokens, are an "
                                    "attention layer's", "serve an LFM2 checkpoint with attention layers (every "
                                    "released LFM2 has them)")
    taps = getattr(cfg, "conv_L_cache", None)
    if type(taps) is not int or taps < 2:
        raise UnsupportedModelError(f"{cfg.model_type} with conv_L_cache {json.dumps(taps)} is not supported (a conv "
                                    "of 2 or more taps)", "use the config.json that came with the weights (LFM2's: 3)")


def check_falcon_h1(cfg) -> None:
    """Falcon-H1's Mamba-2 heads that its groups do not divide, mlp_multipliers other than (gate, down) and
    ssm_multipliers other than (z, x, B, C, dt): refused naming them (models.falcon_h1)."""
    heads, groups = getattr(cfg, "mamba_n_heads", 1), getattr(cfg, "mamba_n_groups", 1)
    if not groups or heads % groups:
        raise UnsupportedModelError(f"falcon_h1 with mamba_n_heads {heads} in mamba_n_groups {groups} is not "
                                    "supported: each group's B and C serve mamba_n_heads / mamba_n_groups heads",
                                    "use the config.json that came with the weights")
    for field, n, what in (("mlp_multipliers", 2, "the gate's and down_proj's"),
                           ("ssm_multipliers", 5, "in_proj's z, x, B, C and dt columns'")):
        values = getattr(cfg, field, None)
        if not isinstance(values, (list, tuple)) or len(values) != n \
                or not all(type(v) in (int, float) for v in values):
            raise UnsupportedModelError(f"falcon_h1 {field} {json.dumps(values)} is not {n} numbers",
                                        f"Falcon-H1's {field} are {what} multipliers: use the config.json that came "
                                        "with the weights")


def model_class(cfg):
    check_supported(cfg)
    if cfg.model_type in LFM2:
        from .lfm2 import lfm2_class
        from .moe import is_moe
        return lfm2_class(is_hybrid(cfg), is_moe(cfg))
    if cfg.model_type == "falcon_h1":
        from .falcon_h1 import falcon_h1_class
        return falcon_h1_class()
    if cfg.model_type == "nemotron_h":
        from .nemotron_h import nemotron_h_class
        return nemotron_h_class(is_hybrid(cfg))
    if cfg.model_type == "granitemoehybrid":
        from .granite4 import granite4_class
        return granite4_class(is_hybrid(cfg))
    if cfg.model_type == "bamba":
        from .bamba import bamba_class
        return bamba_class(is_hybrid(cfg))
    if cfg.model_type in HYBRID:
        from .qwen3_5 import Qwen3_5ForCausalLM, qwen3_next_class
        return Qwen3_5ForCausalLM if cfg.model_type == "qwen3_5_text" else qwen3_next_class()
    from .shapes import is_mla
    if is_mla(cfg):  # (DeepSeek's multi-head latent attention)
        from .deepseek import deepseek_class
        return deepseek_class()
    if cfg.model_type == "llama4_text":  # (dense or with experts: models.llama4)
        from .llama4 import Llama4ForCausalLM
        return Llama4ForCausalLM
    from .moe import is_moe, moe_model_class
    if is_moe(cfg):
        return moe_model_class({"granitemoe": "granite", "granitemoeshared": "granite",
                                "hunyuan_v1_moe": "hunyuan", "phimoe": "phimoe",
                                "flex_olmo": "olmo2"}.get(cfg.model_type, "llama"))
    from .llama import (ApertusForCausalLM, ArceeForCausalLM, CohereForCausalLM, Exaone4ForCausalLM, Gemma2ForCausalLM,
                        Gemma3ForCausalLM, GemmaForCausalLM, Glm4ForCausalLM, GraniteForCausalLM, GraniteSWAForCausalLM,
                        HunYuanDenseV1ForCausalLM, LlamaForCausalLM, NemotronForCausalLM, Olmo2ForCausalLM,
                        Olmo3ForCausalLM, Phi3ForCausalLM, SmolLM3ForCausalLM,
                        Starcoder2ForCausalLM)
    return {"phi3": Phi3ForCausalLM, "gemma": GemmaForCausalLM, "gemma2": Gemma2ForCausalLM,
            "gemma3_text": Gemma3ForCausalLM, "granite": GraniteForCausalLM,
            "olmo2": Olmo2ForCausalLM, "olmo3": Olmo3ForCausalLM,
            "glm4": Glm4ForCausalLM, "smollm3": SmolLM3ForCausalLM, "cohere": CohereForCausalLM,
            "cohere2": CohereForCausalLM, "exaone4": Exaone4ForCausalLM,
            "starcoder2": Starcoder2ForCausalLM, "arcee": ArceeForCausalLM, "nemotron": NemotronForCausalLM,
            "apertus": ApertusForCausalLM, "hunyuan_v1_dense": HunYuanDenseV1ForCausalLM,
            "granite_swa": GraniteSWAForCausalLM}.get(cfg.model_type, LlamaForCausalLM)


def is_hybrid(cfg) -> bool:
    """Whether the model keeps a linear-attention state per sequence (HYBRID: Qwen3.5; Granite 4.0 and Nemotron-H
    with Mamba-2 layers; LFM2 with short-conv layers; Falcon-H1)."""
    model_type = getattr(cfg, "model_type", None)
    if model_type in ("granitemoehybrid", "nemotron_h", "bamba"):
        return "linear_attention" in (getattr(cfg, "layer_types", None) or [])
    if model_type in LFM2:  # (LFM2's short convs: models.lfm2)
        return "conv" in (getattr(cfg, "layer_types", None) or [])
    if model_type == "falcon_h1":  # (a Mamba-2 mixer on every layer: models.falcon_h1)
        return True
    return model_type in HYBRID
