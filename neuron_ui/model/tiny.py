"""The offline tiny model: real diffusers classes at toy size, with a tokenizer made locally."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
# From diffusers' subpackages, not diffusers: mypy reads diffusers 0.42's top-level names as their torch-less dummies.
from diffusers.models import AutoencoderKLFlux2, Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM

# Qwen3's chat template, reduced to what Flux2KleinPipeline renders: one user turn, thinking off.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def build_tiny_tokenizer() -> Qwen2Tokenizer:
    """A byte-level tokenizer made locally: every UTF-8 byte is a token, plus Qwen's special tokens."""
    vocab = {char: index for index, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = Qwen2Tokenizer(  # the fast tokenizer: transformers 5 has no other (Qwen2TokenizerFast is this)
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", "<think>", "</think>"],
        model_max_length=512,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@dataclass(frozen=True)
class KleinShape:
    """FLUX.2-klein-4B's architecture (shared/reference/klein-4b-architecture.md); smaller values for tests and the
    tiny model (TINY)."""

    num_layers: int = 5
    num_single_layers: int = 20
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    timestep_guidance_channels: int = 256
    text_hidden_size: int = 2560
    text_layers: int = 36
    text_heads: int = 32
    text_kv_heads: int = 8
    text_head_dim: int = 128
    text_intermediate_size: int = 9728
    text_vocab_size: int | None = 151936  # None: the tokenizer's own
    text_positions: int = 40960
    text_rope_theta: float = 1_000_000
    text_tied_embeddings: bool = True
    vae_channels: tuple[int, ...] = (128, 256, 512, 512)
    vae_layers_per_block: int = 2
    vae_groups: int = 32
    vae_attention: bool = True
    latent_channels: int = 32
    vae_sample_size: int = 1024


# Klein's layout in miniature. Six transformer blocks of two classes make regional compilation meaningful; the text
# encoder has 28 layers so the pipeline's default hidden-state layers (9, 18, 27) exist; the VAE downsamples 8x like
# the real one, so resolutions and token counts match klein's.
TINY = KleinShape(num_layers=2, num_single_layers=4, attention_head_dim=16, num_attention_heads=2,
                  timestep_guidance_channels=32, text_hidden_size=16, text_layers=28, text_heads=2, text_kv_heads=1,
                  text_head_dim=8, text_intermediate_size=32, text_vocab_size=None, text_positions=512,
                  text_rope_theta=10_000.0, text_tied_embeddings=False, vae_channels=(8, 8, 16, 16),
                  vae_layers_per_block=1, vae_groups=4, latent_channels=4, vae_sample_size=64,
                  vae_attention=False)  # attention over 128x128 latents would dominate a tiny model


def build_tiny_pipeline(dtype: torch.dtype = torch.float32, seed: int = 0) -> Flux2KleinPipeline:
    """Random weights, real diffusers classes, klein's layout in miniature (TINY); the same seed builds the same
    model."""
    return build_random_klein_pipeline(dtype, shape=TINY, seed=seed)


def build_random_klein_pipeline(dtype: torch.dtype, device: str = "cpu", shape: KleinShape = KleinShape(),
                                seed: int = 0) -> Flux2KleinPipeline:
    """The klein layout of `shape` (klein-4B's by default) with random weights, built offline on `device`, step- and
    guidance-distilled: its cost per image is the real model's (compute does not depend on the weights' values),
    without downloading 16 GB."""
    tokenizer = build_tiny_tokenizer()  # prompts are padded to 512 tokens whatever the vocabulary
    # Each module is built in `dtype`, as from_pretrained builds it (transformers sets the default dtype the same way):
    # built in float32 and cast, klein's text encoder alone took 16 GB and the process was killed (issue 45). None of
    # the three classes keeps a module in float32 (`_keep_in_fp32_modules`, tests/test_tiny_dtype.py).
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(seed)
            text_encoder = Qwen3ForCausalLM(Qwen3Config(
                hidden_size=shape.text_hidden_size, intermediate_size=shape.text_intermediate_size,
                num_hidden_layers=shape.text_layers, num_attention_heads=shape.text_heads,
                num_key_value_heads=shape.text_kv_heads, head_dim=shape.text_head_dim,
                vocab_size=shape.text_vocab_size or len(tokenizer), max_position_embeddings=shape.text_positions,
                rope_parameters={"rope_theta": shape.text_rope_theta, "rope_type": "default"}, rms_norm_eps=1e-6,
                tie_word_embeddings=shape.text_tied_embeddings, pad_token_id=tokenizer.pad_token_id))
            transformer = Flux2Transformer2DModel(
                patch_size=1, in_channels=4 * shape.latent_channels,  # the VAE's latents, 2x2 patches in a token
                num_layers=shape.num_layers, num_single_layers=shape.num_single_layers,
                attention_head_dim=shape.attention_head_dim, num_attention_heads=shape.num_attention_heads,
                joint_attention_dim=3 * shape.text_hidden_size,  # 3 stacked text-encoder layers
                timestep_guidance_channels=shape.timestep_guidance_channels, mlp_ratio=3.0,
                axes_dims_rope=(shape.attention_head_dim // 4,) * 4, rope_theta=2000, eps=1e-6, guidance_embeds=False)
            vae = AutoencoderKLFlux2(
                block_out_channels=shape.vae_channels, layers_per_block=shape.vae_layers_per_block,
                latent_channels=shape.latent_channels, norm_num_groups=shape.vae_groups,
                mid_block_add_attention=shape.vae_attention, sample_size=shape.vae_sample_size)
    finally:
        torch.set_default_dtype(default_dtype)
    return Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, transformer=transformer, is_distilled=True)
