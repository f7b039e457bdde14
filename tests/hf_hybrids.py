"""Tiny random hybrid and state-space transformers decoders, built offline from their configs:
2 to 4 layers, hidden 32, a vocabulary of 128, weights large enough (``initializer_range``
0.5) that greedy tokens vary. Each hybrid has a recurrent layer first and an attention layer
last; each keeps the kernels of its own modeling file's torch path (no hub kernels)."""

from __future__ import annotations

VOCAB = 128


def configs() -> dict:
    """Each family's config (transformers' own classes; text configs for multimodal ones)."""
    import transformers as tr

    common = dict(vocab_size=VOCAB, hidden_size=32, initializer_range=0.5,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  tie_word_embeddings=False)
    attention = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     max_position_embeddings=256)
    mamba2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
                  mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16)
    return {
        # Gated DeltaNet (conv window and delta-rule state) and gated attention
        "qwen3_5": tr.Qwen3_5TextConfig(
            **common, **attention, intermediate_size=64, num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention",
                         "full_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=4),
        "qwen3_next": tr.Qwen3NextConfig(
            **common, **attention, intermediate_size=64, num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, shared_expert_intermediate_size=16),
        # short convolutions and attention
        "lfm2": tr.Lfm2Config(
            **common, **attention, intermediate_size=64, num_hidden_layers=3,
            layer_types=["conv", "full_attention", "conv"], conv_L_cache=3),
        # Mamba 2 and attention
        "bamba": tr.BambaConfig(
            **common, **attention, **mamba2, intermediate_size=64, num_hidden_layers=2,
            attn_layer_indices=[1]),
        "granitemoehybrid": tr.GraniteMoeHybridConfig(
            **common, **attention, **mamba2, intermediate_size=64, num_hidden_layers=2,
            layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
            shared_intermediate_size=32),
        # pure state space
        "mamba": tr.MambaConfig(**common, state_size=8, num_hidden_layers=2, expand=2,
                                conv_kernel=4, use_mambapy=False),
        "falcon_mamba": tr.FalconMambaConfig(**common, state_size=8, num_hidden_layers=2,
                                             expand=2, conv_kernel=4),
        "mamba2": tr.Mamba2Config(**common, num_heads=4, head_dim=16, state_size=8,
                                  num_hidden_layers=2, expand=2, conv_kernel=4, n_groups=1,
                                  chunk_size=16),
        # the families beside them that the same code serves: Mamba 2, an MLP and a MoE layer
        # that keep nothing, and attention
        "nemotron_h": tr.NemotronHConfig(
            **common, **attention, layers_block_type=["mamba", "mlp", "attention", "moe"],
            num_hidden_layers=4, intermediate_size=64, ssm_state_size=8, mamba_num_heads=4,
            mamba_head_dim=16, n_groups=1, conv_kernel=4, expand=2, chunk_size=16,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16),
        # Mamba (1) and attention with experts
        "jamba": tr.JambaConfig(
            **common, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            intermediate_size=64, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
            expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
            mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, use_mamba_kernels=False),
        # Gated DeltaNet (OLMo's) and attention
        "olmo_hybrid": tr.OlmoHybridConfig(
            **common, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            intermediate_size=64, num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16),
        "lfm2_moe": tr.Lfm2MoeConfig(
            **common, **attention, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=3, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
            layer_types=["conv", "full_attention", "conv"]),
        "qwen3_5_moe": tr.Qwen3_5MoeTextConfig(
            **common, **attention, num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, shared_expert_intermediate_size=16),
    }


def refused_configs() -> dict:
    """Families whose layers keep both keys and values and a state in one layer (transformers'
    ``hybrid`` cache layers), which cacheidx refuses."""
    import transformers as tr

    common = dict(vocab_size=VOCAB, hidden_size=32, initializer_range=0.5,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return {
        # attention and Mamba 2 side by side in every layer
        "falcon_h1": tr.FalconH1Config(
            **common, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=256, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
            mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
            mamba_d_ssm=64, intermediate_size=64, num_hidden_layers=2),
        # a shared attention block beside a Mamba 2 layer
        "zamba2": tr.Zamba2Config(
            **common, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
            num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"],
            mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, n_mamba_heads=4, chunk_size=16,
            intermediate_size=64, use_mamba_kernels=False),
    }


FAMILIES = ["qwen3_5", "qwen3_next", "lfm2", "bamba", "granitemoehybrid", "mamba",
            "falcon_mamba", "mamba2", "nemotron_h", "jamba", "olmo_hybrid", "lfm2_moe",
            "qwen3_5_moe"]


def tiny(name: str, seed: int = 0):
    """The family's tiny model (of :func:`configs` or :func:`refused_configs`): float32, eager
    attention, eval mode, no end token."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = {**configs(), **refused_configs()}[name]
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
