"""The default model: a published Qwen3-TTS GGUF pair, fetched into the Hugging Face cache."""

from __future__ import annotations

from pathlib import Path

from ..errors import UsageError

DEFAULT_REPO = "ggml-org/Qwen3-TTS-12Hz-1.7B-Base-GGUF"  # the pair llama.cpp's tools/tts uses
DEFAULT_PATTERNS = ["*Q8_0*.gguf"]
OFFLINE_HINT = (
    "to make a model offline: python tools/make_random_checkpoint.py --preset 0.6b "
    "--kind custom_voice --seed 0 CKPT && kazeia-stream convert CKPT MODEL_DIR, "
    "or convert a downloaded official checkpoint; then pass --model MODEL_DIR "
    "or set KAZEIA_MODEL"
)


def fetch_default_model() -> Path:
    """The folder of the default pair, downloading it on first use (the `hf` extra)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise UsageError(
            f"no model given and huggingface_hub is not installed to fetch {DEFAULT_REPO} "
            f"(pip install 'kazeia-stream[hf]'); {OFFLINE_HINT}"
        ) from None
    try:
        return Path(snapshot_download(DEFAULT_REPO, allow_patterns=DEFAULT_PATTERNS))
    except Exception as e:  # network, authentication, disk: all end the same way for the user
        raise UsageError(
            f"could not fetch the default model {DEFAULT_REPO} ({type(e).__name__}); {OFFLINE_HINT}"
        ) from None
