"""The diffusion policy: a diffusers ``StableDiffusion3Pipeline`` directory, and a tiny one built from configs.

A policy directory is what ``StableDiffusion3Pipeline.save_pretrained`` writes (``model_index.json`` and one
folder per component). The trained component is the flow-matching transformer (``transformer/``); the
text encoders and the VAE stay frozen. :func:`build_tiny_policy` writes a complete, randomly initialised
SD3-style pipeline — two CLIP text encoders with a small BPE vocabulary, an ``SD3Transformer2DModel``, a
TAESD-style ``AutoencoderTiny`` whose decoder is set to a known colour map (:func:`set_rgb_decoder`) and a
``FlowMatchEulerDiscreteScheduler`` — small enough to sample 32 x 32 images on a
laptop CPU in milliseconds; tests, the example and the benchmark use it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.precision.dtypes import torch_dtype

if TYPE_CHECKING:
    from diffusers import StableDiffusion3Pipeline

__all__ = [
    "TINY_WORDS",
    "build_tiny_policy",
    "load_pipeline",
    "load_transformer",
    "quiet_loading",
    "set_rgb_decoder",
]

log = logging.getLogger(__name__)

TINY_WORDS = (
    "a", "an", "the", "of", "photo", "picture", "painting", "image", "red", "green", "blue", "white", "black",
    "yellow", "bright", "dark", "cat", "dog", "square", "circle", "sky", "sea", "tree", "house", "sun", "night",
)  # fmt: skip
"""Words the tiny tokenizer has whole tokens for (anything else still tokenises, byte by byte)."""

_OPTIONAL = ("text_encoder_3", "tokenizer_3", "image_encoder", "feature_extractor")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP's reversible map of the 256 byte values to printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _write_clip_vocab(folder: Path, words: tuple[str, ...]) -> tuple[Path, Path, int]:
    """A CLIP BPE vocabulary: every byte (alone and word-final), merges that build ``words``, the specials."""
    symbols = list(_bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for symbol in [*symbols, *(s + "</w>" for s in symbols)]:
        vocab[symbol] = len(vocab)
    merges: list[tuple[str, str]] = []
    for word in words:
        parts = [*word[:-1], word[-1] + "</w>"]
        while len(parts) > 1:
            pair = (parts[0], parts[1])
            if pair not in merges:
                merges.append(pair)
            parts = [parts[0] + parts[1], *parts[2:]]
            vocab.setdefault(parts[0], len(vocab))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    folder.mkdir(parents=True, exist_ok=True)
    vocab_file, merges_file = folder / "vocab.json", folder / "merges.txt"
    vocab_file.write_text(json.dumps(vocab), encoding="utf-8")
    merges_file.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    return vocab_file, merges_file, len(vocab)


def build_tiny_policy(
    path: str | Path,
    *,
    seed: int = 0,
    image_size: int = 32,
    latent_channels: int = 4,
    num_layers: int = 2,
    heads: int = 4,
    head_dim: int = 8,
    text_hidden: int = 32,
    max_prompt_tokens: int = 16,
) -> Path:
    """Write a randomly initialised SD3-style pipeline directory to ``path`` (deterministic for ``seed``).

    The VAE downsamples 4x, the transformer patches 2 x 2 latents, so a 32 x 32 image is 64 latent
    positions and 16 image tokens. Both CLIP encoders share one tokenizer (as SD3's do); there is no T5
    (``text_encoder_3`` is ``None``, as SD3 allows), so the T5 part of the prompt embedding is zeros.
    """
    import torch
    from diffusers import (
        AutoencoderTiny,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

    out = Path(path)
    vocab_file, merges_file, vocab_size = _write_clip_vocab(out / "_vocab", TINY_WORDS)
    tokenizer = CLIPTokenizer(str(vocab_file), str(merges_file), model_max_length=max_prompt_tokens)
    ids = tokenizer.convert_tokens_to_ids(["<|startoftext|>", "<|endoftext|>"])
    text_config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=text_hidden,
        intermediate_size=2 * text_hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=max_prompt_tokens,
        projection_dim=text_hidden,
        bos_token_id=ids[0],
        eos_token_id=ids[1],
        pad_token_id=ids[1],
    )
    torch.manual_seed(seed)
    text_encoder = CLIPTextModelWithProjection(text_config)
    text_encoder_2 = CLIPTextModelWithProjection(text_config)
    vae_blocks = 3  # 2 ** (blocks - 1) = 4x downsampling
    latent_size = image_size // 2 ** (vae_blocks - 1)
    transformer = SD3Transformer2DModel(
        sample_size=latent_size,
        patch_size=2,
        in_channels=latent_channels,
        out_channels=latent_channels,
        num_layers=num_layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=2 * text_hidden,
        caption_projection_dim=heads * head_dim,
        pooled_projection_dim=2 * text_hidden,
        pos_embed_max_size=max(latent_size // 2, 4) * 2,
    )
    vae = AutoencoderTiny(
        in_channels=3,
        out_channels=3,
        encoder_block_out_channels=(8,) * vae_blocks,
        decoder_block_out_channels=(8,) * vae_blocks,
        num_encoder_blocks=(1,) * vae_blocks,
        num_decoder_blocks=(1,) * vae_blocks,
        latent_channels=latent_channels,
        scaling_factor=1.0,
        shift_factor=0.0,
    )
    set_rgb_decoder(vae)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    quiet_loading()
    pipe.save_pretrained(out)
    for file in (vocab_file, merges_file):
        file.unlink()
    (out / "_vocab").rmdir()
    log.info("wrote a tiny SD3-style policy (%d transformer parameters) to %s", transformer.num_parameters(), out)
    return out


def set_rgb_decoder(vae: Any) -> None:
    """Make a TAESD-style ``AutoencoderTiny``'s decoder the known map ``rgb = 0.5 + 0.45 tanh(z[:3] / 3)``,
    nearest-upsampled: its first three latent channels are the image's colours.

    A randomly initialised decoder maps every latent to nearly the same image, so pixel rewards would not
    depend on what the transformer does; with this one, brightness and colour are the latent's mean. The
    weights are set, not trained: the first conv splits each channel into ``3.5 +/- z`` (positive, so every
    ReLU passes it), every residual block's last conv is zero (the block is the identity), the inner convs
    copy their input, and the last conv takes ``0.075 (a - b)`` per colour, plus 0.5.
    """
    import torch

    layers = list(vae.decoder.layers)
    convs = [m for m in layers if isinstance(m, torch.nn.Conv2d)]
    first, inner, last = convs[0], convs[1:-1], convs[-1]
    width = first.out_channels
    if width < 6 or vae.config.latent_channels < 3:
        raise ValueError("set_rgb_decoder needs at least 6 decoder channels and 3 latent channels")
    with torch.no_grad():
        for conv in (first, *inner, last):
            conv.weight.zero_()
            if conv.bias is not None:
                conv.bias.zero_()
        for c in range(3):
            first.weight[c, c, 1, 1] = 1.0
            first.weight[3 + c, c, 1, 1] = -1.0
            first.bias[c] = first.bias[3 + c] = 3.5
            last.weight[c, c, 1, 1] = 0.075
            last.weight[c, 3 + c, 1, 1] = -0.075
            last.bias[c] = 0.5
        for conv in inner:
            for k in range(width):
                conv.weight[k, k, 1, 1] = 1.0
        for block in layers:
            if hasattr(block, "skip") and hasattr(block, "conv"):
                block.conv[-1].weight.zero_()
                block.conv[-1].bias.zero_()


def _absent_components(path: Path) -> dict[str, Any]:
    """``{name: None}`` for the optional components the directory does not hold (diffusers wants them named)."""
    index = path / "model_index.json"
    if not index.exists():
        raise FileNotFoundError(f"{path}: not a diffusers pipeline directory (no model_index.json)")
    listed = json.loads(index.read_text(encoding="utf-8"))
    return {name: None for name in _OPTIONAL if not (isinstance(listed.get(name), list) and listed[name][0])}


def load_pipeline(
    path: str | Path,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    transformer: bool = True,
    vae: bool = True,
) -> StableDiffusion3Pipeline:
    """The pipeline at ``path`` on ``device`` in ``dtype``, progress bars off; ``transformer=False`` /
    ``vae=False`` leave those components out (the trainer loads its transformer itself)."""
    from diffusers import StableDiffusion3Pipeline

    quiet_loading()
    folder = Path(path)
    skip = _absent_components(folder)
    if not transformer:
        skip["transformer"] = None
    if not vae:
        skip["vae"] = None
    wanted = torch_dtype(dtype, field=None)
    pipe = StableDiffusion3Pipeline.from_pretrained(folder, dtype=wanted, **skip)
    pipe.set_progress_bar_config(disable=True)
    # every component in ``dtype``: diffusers 0.42 leaves the transformer in float32 when asked for bfloat16, and
    # the engine's bfloat16 latents then met float32 weights at the first convolution
    return pipe.to(device=device, dtype=wanted)


def load_transformer(path: str | Path, *, dtype: str = "float32") -> Any:
    """The policy's ``SD3Transformer2DModel`` (``path/transformer``), on the CPU."""
    from diffusers import SD3Transformer2DModel

    quiet_loading()
    folder = Path(path) / "transformer"
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{path}: no transformer/config.json (train.model_path must be a pipeline directory)")
    return SD3Transformer2DModel.from_pretrained(folder, dtype=torch_dtype(dtype, field=None))


def quiet_loading() -> None:
    """No progress bars from diffusers and transformers while loading (logs stay readable)."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
