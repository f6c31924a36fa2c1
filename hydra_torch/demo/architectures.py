"""Small, randomly initialised decoder-only models of each family the Hugging Face adapters are tested on: what
`python -m hydra_torch.demo --arch NAME` trains and what tests/test_hf_decoders.py checks against plain training.

Each is built from its own config class with the given shape; what a family adds (experts, sliding windows, a
softcap, learned positions, a narrower embedding) is switched on, so that its path through the adapter runs.
"""
from __future__ import annotations

import torch


def _rotary(config_class, **family):
    def build(vocab, width, layers, heads, positions):
        import transformers

        kwargs = dict(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                      max_position_embeddings=positions, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        kwargs.update({k: v(width, heads, layers) if callable(v) else v for k, v in family.items()})
        return getattr(transformers, config_class)(**kwargs)

    return build


def _alternating(width, heads, layers):
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def _head_dim(width, heads, layers):
    return width // heads


def _opt(vocab, width, layers, heads, positions):
    from transformers import OPTConfig

    return OPTConfig(vocab_size=vocab, hidden_size=width, ffn_dim=2 * width, num_hidden_layers=layers,
                     num_attention_heads=heads, max_position_embeddings=positions, word_embed_proj_dim=width // 2,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _gpt2(vocab, width, layers, heads, positions):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=width, n_layer=layers, n_head=heads,
                      bos_token_id=0, eos_token_id=0)


# name -> (config builder, model class name)
CONFIGS = {
    "gpt2": (_gpt2, "GPT2LMHeadModel"),
    "llama": (_rotary("LlamaConfig"), "LlamaForCausalLM"),
    "mistral": (_rotary("MistralConfig", sliding_window=8), "MistralForCausalLM"),
    "mixtral": (_rotary("MixtralConfig", num_local_experts=4, num_experts_per_tok=2), "MixtralForCausalLM"),
    "qwen2": (_rotary("Qwen2Config", tie_word_embeddings=True), "Qwen2ForCausalLM"),
    "qwen3": (_rotary("Qwen3Config", head_dim=_head_dim), "Qwen3ForCausalLM"),
    "qwen3_moe": (_rotary("Qwen3MoeConfig", head_dim=_head_dim, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=lambda w, h, n: w), "Qwen3MoeForCausalLM"),
    "phi": (_rotary("PhiConfig"), "PhiForCausalLM"),
    "phi3": (_rotary("Phi3Config"), "Phi3ForCausalLM"),
    "gemma": (_rotary("GemmaConfig", head_dim=_head_dim), "GemmaForCausalLM"),
    "gemma2": (_rotary("Gemma2Config", head_dim=_head_dim, sliding_window=8, layer_types=_alternating),
               "Gemma2ForCausalLM"),
    "gemma3": (_rotary("Gemma3TextConfig", head_dim=_head_dim, sliding_window=8, layer_types=_alternating,
                       final_logit_softcapping=30.0), "Gemma3ForCausalLM"),
    "olmo": (_rotary("OlmoConfig"), "OlmoForCausalLM"),
    "olmo2": (_rotary("Olmo2Config"), "Olmo2ForCausalLM"),
    "smollm3": (_rotary("SmolLM3Config"), "SmolLM3ForCausalLM"),
    "gpt_neox": (_rotary("GPTNeoXConfig"), "GPTNeoXForCausalLM"),
    "opt": (_opt, "OPTForCausalLM"),
}


def build(arch: str, vocab: int, width: int, layers: int, heads: int, positions: int, seed: int = 0):
    """A randomly initialised model of family `arch` (a key of CONFIGS), in fp32 on the CPU, in train mode."""
    import transformers

    if arch not in CONFIGS:
        raise ValueError(f"unknown architecture {arch!r}: choose one of {', '.join(CONFIGS)}")
    make_config, model_class = CONFIGS[arch]
    config = make_config(vocab, width, layers, heads, positions)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    model.train()
    return model
