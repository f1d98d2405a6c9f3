"""Model presets for `asteria.train`: OLMo-2-style decoders built from a config, never downloaded.

Owns: the preset table and turning a preset into a Hugging Face ``Olmo2Config`` /
``Olmo2ForCausalLM`` (RMSNorm after attention and MLP, QK-norm, SwiGLU, RoPE, no biases, untied
embeddings). Must not: fetch weights or tokenizers, or know about data or optimizers.

MLP width: OLMo's rule, about 8/3 of the model width rounded up to a multiple of 128 (for the 7B
that is 11008 per projection; OLMo's own config writes the fused gate+up width, 22016). The large
presets are config entries for GPU runs with a real tokenizer; on CPU use ``tiny``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import Olmo2Config, Olmo2ForCausalLM


def olmo_mlp_width(hidden_size: int) -> int:
    """OLMo's SwiGLU width: ceil(8/3 * hidden_size) rounded up to a multiple of 128."""
    return 128 * math.ceil(math.ceil(8 * hidden_size / 3) / 128)


@dataclass(frozen=True)
class ModelPreset:
    """Shape of one decoder: width, depth, heads, MLP width and the longest sequence it takes."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    max_seq_len: int
    note: str

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"preset {self.name!r}: hidden_size {self.hidden_size} is not divisible by "
                f"num_heads {self.num_heads}"
            )

    @property
    def intermediate_size(self) -> int:
        return olmo_mlp_width(self.hidden_size)


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("nano", 128, 2, 4, 256, "0.5M params at the byte vocab; for quick tests"),
        ModelPreset("tiny", 256, 4, 4, 256, "3.5M params at the byte vocab; the CPU default"),
        ModelPreset("olmo-60m", 384, 12, 6, 2048, "60M params at a 50k vocab"),
        ModelPreset("olmo-150m", 768, 12, 12, 2048, "162M params at a 50k vocab"),
        ModelPreset("olmo-660m", 1408, 24, 22, 2048, "the SOAP paper's 660m shape"),
        ModelPreset("olmo2-1b", 2048, 24, 16, 4096, "24 layers (released OLMo-2 1B: 16)"),
        ModelPreset("olmo2-7b", 4096, 32, 32, 4096, "OLMo-2 7B: 7.30B params at a 100k vocab"),
    )
}


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``; ``ValueError`` listing the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(PRESETS)}") from None


def olmo2_config(preset: ModelPreset, *, vocab_size: int, max_seq_len: int) -> Olmo2Config:
    """The ``Olmo2Config`` for ``preset`` with the data's vocabulary and sequence length."""
    if max_seq_len > preset.max_seq_len:
        raise ValueError(
            f"seq_len {max_seq_len} exceeds model {preset.name!r}'s maximum {preset.max_seq_len}"
        )
    return Olmo2Config(
        vocab_size=vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_heads,
        max_position_embeddings=preset.max_seq_len,
        rope_theta=500_000.0,
        tie_word_embeddings=False,
        use_cache=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=vocab_size - 1,
    )


def num_params(preset: ModelPreset, *, vocab_size: int) -> int:
    """Parameter count of ``preset`` at ``vocab_size``, computed without building the model."""
    d, f = preset.hidden_size, preset.intermediate_size
    per_layer = 4 * d * d + 3 * d * f + 4 * d  # q,k,v,o + gate,up,down + 4 RMSNorm weights
    return preset.num_layers * per_layer + 2 * vocab_size * d + d  # embeddings, lm_head, norm


def build_model(
    preset: ModelPreset, *, vocab_size: int, max_seq_len: int, seed: int
) -> Olmo2ForCausalLM:
    """A freshly initialized model; the same ``seed`` gives the same weights."""
    config = olmo2_config(preset, vocab_size=vocab_size, max_seq_len=max_seq_len)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Olmo2ForCausalLM(config)
    return model
