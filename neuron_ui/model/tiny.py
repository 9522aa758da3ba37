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


def distilled_klein(tokenizer, text_encoder, transformer, vae) -> Flux2KleinPipeline:
    """Assemble a step- and guidance-distilled klein pipeline from components built in code."""
    return Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=True,
    )


def build_tiny_pipeline(dtype: torch.dtype = torch.float32, seed: int = 0) -> Flux2KleinPipeline:
    """Random weights, real diffusers classes, klein's layout in miniature; the same seed builds the same model.

    Six transformer blocks of two classes make regional compilation meaningful; the text encoder has 28
    layers so the pipeline's default hidden-state layers (9, 18, 27) exist; the VAE downsamples 8x like
    the real one, so resolutions and token counts match klein's.
    """
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(seed)
    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=28,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            vocab_size=len(tokenizer),
            max_position_embeddings=512,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=4,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=48,  # 3 stacked text-encoder layers of 16
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=False,
    )
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        mid_block_add_attention=False,  # attention over 128x128 latents would dominate a tiny model
        sample_size=64,
    )
    pipe = distilled_klein(tokenizer, text_encoder, transformer, vae)
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


@dataclass(frozen=True)
class KleinShape:
    """FLUX.2-klein-4B's architecture (shared/reference/klein-4b-architecture.md); smaller values for tests."""

    num_layers: int = 5
    num_single_layers: int = 20
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    text_hidden_size: int = 2560
    text_layers: int = 36
    text_heads: int = 32
    text_kv_heads: int = 8
    text_intermediate_size: int = 9728
    text_vocab_size: int = 151936
    vae_channels: tuple[int, ...] = (128, 256, 512, 512)


def build_random_klein_pipeline(dtype: torch.dtype, device: str = "cpu",
                                shape: KleinShape = KleinShape()) -> Flux2KleinPipeline:
    """The real klein-4B layout with random weights, built offline on `device`: its cost per image is the
    real model's (compute does not depend on the weights' values), without downloading 16 GB."""
    tokenizer = build_tiny_tokenizer()  # prompts are padded to 512 tokens whatever the vocabulary
    with torch.device(device):
        torch.manual_seed(0)
        text_encoder = Qwen3ForCausalLM(
            Qwen3Config(
                hidden_size=shape.text_hidden_size,
                intermediate_size=shape.text_intermediate_size,
                num_hidden_layers=shape.text_layers,
                num_attention_heads=shape.text_heads,
                num_key_value_heads=shape.text_kv_heads,
                head_dim=128,
                vocab_size=shape.text_vocab_size,
                max_position_embeddings=40960,
                rope_parameters={"rope_type": "default", "rope_theta": 1_000_000},
                rms_norm_eps=1e-6,
                tie_word_embeddings=True,
                pad_token_id=tokenizer.pad_token_id,
            )
        ).to(dtype)  # type: ignore[arg-type]  # transformers 5.25 wraps PreTrainedModel.to; typeshed's wraps drops `self`
        transformer = Flux2Transformer2DModel(
            patch_size=1,
            in_channels=128,
            num_layers=shape.num_layers,
            num_single_layers=shape.num_single_layers,
            attention_head_dim=shape.attention_head_dim,
            num_attention_heads=shape.num_attention_heads,
            joint_attention_dim=3 * shape.text_hidden_size,
            timestep_guidance_channels=256,
            mlp_ratio=3.0,
            axes_dims_rope=(shape.attention_head_dim // 4,) * 4,
            rope_theta=2000,
            eps=1e-6,
            guidance_embeds=False,
        ).to(dtype)
        vae = AutoencoderKLFlux2(block_out_channels=shape.vae_channels).to(dtype)
    return distilled_klein(tokenizer, text_encoder, transformer, vae)
