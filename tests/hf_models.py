"""Tiny random transformers decoders of every architecture the integration is tested on, built
offline from their configs: 2 layers, hidden 32, 4 query and 2 key-value heads of 8, a
vocabulary of 128, weights large enough (``initializer_range`` 0.5) that greedy tokens vary.
Sliding layers have a window of 4, so that prompts of 5 to 13 tokens reach past it."""

from __future__ import annotations

WINDOW = 4
VOCAB = 128


def configs() -> dict:
    """Each architecture's config and the windows its layers slide by (transformers' own)."""
    import transformers as tr

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  initializer_range=0.5, max_position_embeddings=256, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    w = WINDOW
    return {
        "llama": (tr.LlamaConfig(**common), [None, None]),
        # every layer slides (no layer_types: config.sliding_window)
        "mistral": (tr.MistralConfig(**common, sliding_window=w), [w, w]),
        # layers from max_window_layers on slide
        "qwen2": (tr.Qwen2Config(**common, use_sliding_window=True, sliding_window=w,
                                 max_window_layers=1), [None, w]),
        # query and key norms
        "qwen3": (tr.Qwen3Config(**common), [None, None]),
        # soft-capped scores, its own scaling, alternating windows (untied: tied, greedy
        # tokens repeat one id)
        "gemma2": (tr.Gemma2Config(**common, sliding_window=w, attn_logit_softcapping=5.0,
                                   query_pre_attn_scalar=16, tie_word_embeddings=False),
                   [w, None]),
        "phi3": (tr.Phi3Config(**common, sliding_window=w), [w, w]),
        # layer 1 without rotary positions, and sliding
        "smollm3": (tr.SmolLM3Config(**common, use_sliding_window=True, sliding_window=w,
                                     no_rope_layers=[1, 0]), [None, w]),
        # attention sinks, a mixture of experts, alternating windows
        "gpt_oss": (tr.GptOssConfig(**common, sliding_window=w, num_local_experts=4,
                                    num_experts_per_tok=2,
                                    rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                                     "original_max_position_embeddings": 128,
                                                     "rope_theta": 150000.0,
                                                     "beta_fast": 32.0, "beta_slow": 1.0,
                                                     "truncate": False}),
                    [w, None]),
    }


ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "smollm3", "gpt_oss"]


def tiny(name: str, seed: int = 0):
    """The architecture's tiny model: float32, eager attention, eval mode, no end token."""
    import torch
    from transformers import AutoModelForCausalLM

    config, _ = configs()[name]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                             dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def greedy(model, prompt: list[int], new: int) -> list[int]:
    """transformers' own ``generate`` (greedy, its default cache) on ``prompt`` alone."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()
