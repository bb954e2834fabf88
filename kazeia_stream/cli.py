"""The `kazeia-stream` command: speak text, or one of the subcommands (convert, voices, ...).

Everything but audio goes to stderr; a user error is one line and a non-zero exit.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from .errors import KazeiaError

log = logging.getLogger("kazeia_stream")

MODEL_ENV = "KAZEIA_MODEL"


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="more log output on stderr (-vv includes llama.cpp's own log)")


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=os.environ.get(MODEL_ENV),
                   help=f"folder with the GGUF pair, or the talker .gguf (default: ${MODEL_ENV})")


def _model_path(args: argparse.Namespace) -> str:
    if not args.model:
        raise KazeiaError(f"no model given: pass --model PATH or set {MODEL_ENV} "
                          "(make one offline with `kazeia-stream convert HF_DIR OUT_DIR`)")
    return args.model


def cmd_convert(args: argparse.Namespace) -> int:
    from .model.convert import convert

    talker, mmproj = convert(args.hf_dir, args.out_dir, args.type)
    print(f"wrote {talker}\nwrote {mmproj}", file=sys.stderr)
    return 0


def cmd_voices(args: argparse.Namespace) -> int:
    from .model import load_model

    model = load_model(_model_path(args))
    print(f"model: {model.kind} ({model.config.size}), {model.sample_rate} Hz")
    print("voices: " + (", ".join(model.voices) or "(none: this model has no built-in speakers)"))
    print("languages: " + ", ".join(model.languages))
    return 0


def _convert_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from .model.convert import TYPES

    types = "; ".join(f"{name}: {what}" for name, what in TYPES.items())
    p = sub.add_parser("convert", help="convert an official Hugging Face checkpoint to the GGUF pair",
                       description="Convert an official Qwen3-TTS checkpoint (config.json, "
                       "model.safetensors, vocab.json, merges.txt, speech_tokenizer/) into "
                       f"llama.cpp's GGUF pair. Types: {types}.")
    p.add_argument("hf_dir")
    p.add_argument("out_dir")
    p.add_argument("--type", choices=list(TYPES), default="f16", help="weight type (default f16)")
    p.set_defaults(func=cmd_convert)
    return p


def _voices_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("voices", help="list the speakers and languages of a model")
    _add_model(p)
    p.set_defaults(func=cmd_voices)
    return p


SUBCOMMANDS: dict[str, Callable[[argparse._SubParsersAction], argparse.ArgumentParser]] = {
    "convert": _convert_parser,
    "voices": _voices_parser,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kazeia-stream", description="Speak text with Qwen3-TTS, live.")
    sub = parser.add_subparsers(dest="command", required=True)
    for make in SUBCOMMANDS.values():
        _add_common(make(sub))
    return parser


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, stream=sys.stderr, format="kazeia-stream: %(message)s")
    logging.getLogger("llama.cpp").setLevel(logging.DEBUG if verbose >= 2 else logging.CRITICAL)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.func(args)
    except KazeiaError as e:
        print(f"kazeia-stream: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kazeia-stream: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
