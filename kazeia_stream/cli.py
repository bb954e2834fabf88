"""The `kazeia-stream` command: speak text, or one of the subcommands (convert, voices, ...).

Everything but audio goes to stderr; a user error is one line and a non-zero exit.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import KazeiaError, OutputError, UsageError, leaf
from .pcm import FORMATS

if TYPE_CHECKING:
    import numpy as np

    from .model import Model
    from .model.model import VoiceArg
    from .model.voice import Voice
    from .runtime import Runtime

log = logging.getLogger("kazeia_stream")

MODEL_ENV = "KAZEIA_MODEL"
API_KEY_ENV = "KAZEIA_API_KEY"
# The servers' utterances at once. Each holds a talker KV cache (2048 positions: 235 MB in F16
# beside quantized weights, 470 MB in F32, on the 0.6B and 1.7B); 4 gave 1.4-1.8x one stream's
# throughput on 2 cores, 8 about 2x for twice the memory (README, "Several streams at once").
DEFAULT_SERVER_STREAMS = 4


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="more log output on stderr (-vv includes llama.cpp's own log)",
    )


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        "-m",
        default=os.environ.get(MODEL_ENV),
        help=f"folder with the GGUF pair, or the talker .gguf (default: ${MODEL_ENV})",
    )


def _add_max_streams(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-streams",
        type=_positive,
        default=DEFAULT_SERVER_STREAMS,
        help="utterances generated at once, in shared passes; each holds its own talker KV cache "
        f"(default {DEFAULT_SERVER_STREAMS})",
    )


def _add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=_positive,
        help="CPU threads for the talker and the code predictor (default: every core)",
    )


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `low`."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            n = low - 1
        if n < low:
            raise argparse.ArgumentTypeError(f"expected a whole number of at least {low}, got {value!r}")
        return n

    return parse


_positive = _at_least(1)


def _model_path(args: argparse.Namespace) -> str:
    """--model, else $KAZEIA_MODEL, else the published default pair (downloaded once)."""
    if args.model:
        return args.model
    from .model.download import fetch_default_model

    return str(fetch_default_model())


def cmd_convert(args: argparse.Namespace) -> int:
    from .model.convert import convert

    talker, mmproj = convert(args.hf_dir, args.out_dir, args.type, args.decoder)
    print(f"wrote {talker}\nwrote {mmproj}", file=sys.stderr)
    return 0


def cmd_voices(args: argparse.Namespace) -> int:
    from .model.voice import VoiceLibrary

    model = _model(args)
    model.ready()  # a vocabulary libllama refuses is reported here too
    print(f"model: {model.kind} ({model.config.size}), {model.sample_rate} Hz")
    if model.kind == "base":
        library = VoiceLibrary(args.voices)
        voices = model.saved_voices(library)
        saved = [f"{name} ({voice.mode}, {voice.ref_seconds:.1f} s)" for name, voice in voices.items()]
        print(f"saved voices in {library.folder}: " + (", ".join(saved) or "(none yet)"))
        print('make one: kazeia-stream voice create NAME --ref-audio FILE [--ref-text "what it says"]')
    else:
        print("voices: " + (", ".join(model.voices) or "(none: this model has no built-in speakers)"))
    print("languages: " + ", ".join(model.languages))
    return 0


def cmd_voice_create(args: argparse.Namespace) -> int:
    from .cloning import VoiceEncoders
    from .model.voice import VoiceLibrary

    library = VoiceLibrary(args.voices)
    path = library.path(args.name)  # a bad name fails before any work
    if path.exists() and not args.force:
        raise UsageError(f"voice {args.name!r} exists ({path}); --force replaces it")
    voice = VoiceEncoders(_model(args)).voice(args.ref_audio, ref_text=args.ref_text, name=args.name)
    library.save(voice, args.name)
    print(
        f"saved voice {args.name!r} ({voice.mode}, {voice.ref_seconds:.1f} s of reference) to {path}",
        file=sys.stderr,
    )
    return 0


def _model(args: argparse.Namespace) -> Model:
    from .model import load_model

    return load_model(_model_path(args))


def _runtime(args: argparse.Namespace, model: Model, max_streams: int = 1) -> Runtime:
    """The engines of `model`, with --threads, for up to `max_streams` utterances at once."""
    from .engine.threads import Threads
    from .runtime import Runtime

    threads = Threads.uniform(args.threads) if args.threads is not None else None
    return Runtime(model, threads, max_streams)


def _server_runtime(args: argparse.Namespace, model: Model) -> Runtime:
    """A server's engines: up to --max-streams utterances at once, their memory resident before
    it listens (`Runtime.make_streams_resident`)."""
    runtime = _runtime(args, model, args.max_streams)
    runtime.make_streams_resident()
    return runtime


def cmd_speak(args: argparse.Namespace) -> int:
    if args.pipe and (args.text is not None or args.output):
        raise UsageError("--pipe reads the text from stdin and writes PCM to stdout: no TEXT or -o")
    if not args.pipe and args.text is None:
        raise UsageError('no text given: kazeia-stream "Hello there" (or --pipe to read stdin)')
    if args.pipe and sys.stdin is None:  # Python's streams are None where the fds were closed
        raise UsageError("--pipe reads the text from stdin, which is closed")
    if args.pipe and sys.stdout is None:
        raise OutputError("cannot write to stdout: it is closed")
    model = _model(args)  # first: libllama reads its vocabulary in a thread while these import
    import trio

    from . import live

    session = dict(**_voice(args, model), seed=args.seed)
    runtime = _runtime(args, model)
    if args.pipe:
        mode = functools.partial(live.pipe, runtime, args.format, text_streaming=True, **session)
    elif args.output:
        streaming = args.text_streaming
        mode = functools.partial(
            live.write_file, runtime, args.text, args.output, text_streaming=streaming, **session
        )
    else:
        device = _device(args.device)
        mode = functools.partial(
            live.speak_live, runtime, args.text, device=device, text_streaming=True, **session
        )
    return trio.run(mode)


def _device(device: str | None) -> str | int | None:
    return int(device) if device is not None and device.isdigit() else device


def _convert_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from .model.convert import DECODER_TYPES, TYPES

    types = "; ".join(f"{name}: {what}" for name, what in TYPES.items())
    p = sub.add_parser(
        "convert",
        help="convert an official Hugging Face checkpoint to the GGUF pair",
        description="Convert an official Qwen3-TTS checkpoint (config.json, "
        "model.safetensors, vocab.json, merges.txt, speech_tokenizer/) into "
        f"llama.cpp's GGUF pair. Types: {types}.",
    )
    p.add_argument("hf_dir")
    p.add_argument("out_dir")
    p.add_argument("--type", choices=list(TYPES), default="f16", help="weight type (default f16)")
    p.add_argument(
        "--decoder",
        choices=list(DECODER_TYPES),
        default="f32",
        help="; ".join(f"{name}: {what}" for name, what in DECODER_TYPES.items()) + " (default f32)",
    )
    p.set_defaults(func=cmd_convert)
    return p


def _voices_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("voices", help="list the speakers (or saved voices) and languages of a model")
    _add_model(p)
    _add_voices_dir(p)
    p.set_defaults(func=cmd_voices)
    return p


def _voice_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("voice", help="make a cloned voice (Base models) and save it by name")
    actions = p.add_subparsers(dest="action", required=True)
    create = actions.add_parser(
        "create",
        help="clone a voice from a recording",
        description="Clone a voice from 1-30 s of speech (3-10 s is best) with a Base model and "
        "save it as NAME in the voices folder. With --ref-text (what the recording says) the "
        "voice clones in context (closest to the recording); without it by x-vector only.",
    )
    create.add_argument("name", metavar="NAME")
    _add_model(create)
    create.add_argument("--ref-audio", required=True, help="the recording (wav, flac, ogg, mp3...)")
    create.add_argument("--ref-text", help="its transcript: in-context cloning")
    _add_voices_dir(create)
    create.add_argument("--force", action="store_true", help="replace a saved voice of that name")
    _add_common(create)
    create.set_defaults(func=cmd_voice_create)
    return p


def _add_voices_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--voices",
        metavar="DIR",
        help="folder of saved voices (default: $KAZEIA_VOICES or ~/.local/share/kazeia-stream/voices)",
    )


def cmd_dump(args: argparse.Namespace) -> int:
    import numpy as np

    from .engine.dump import dump

    model = _model(args)
    codec = model.config.codec
    try:
        codes = np.load(args.codes, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UsageError(f"{args.codes}: not a .npy file of codes ({e})") from None
    if not (
        codes.ndim == 2
        and codes.shape[1] == codec.num_quantizers
        and len(codes)
        and np.issubdtype(codes.dtype, np.integer)
    ):
        raise UsageError(
            f"{args.codes}: expected integer codes [N, {codec.num_quantizers}], "
            f"got {codes.dtype} {codes.shape}"
        )
    if codes.min() < 0 or codes.max() >= codec.codebook_size:
        raise UsageError(f"{args.codes}: codes must be between 0 and {codec.codebook_size - 1}")
    extras: dict[str, np.ndarray] = {}
    if args.ref_audio is not None:
        voice, extras = _clone_for_dump(args, model)
        settings = {"voice": voice, "language": args.language, "instruct": args.instruct}
    else:
        settings = _voice(args, model)
    prompt = model.prompt(args.text, **settings, text_streaming=args.text_streaming)
    runtime = _runtime(args, model)
    arrays = dump(
        runtime.talker,
        runtime.code_predictor,
        runtime.codec,
        lambda: runtime.decoder_state(settings["voice"]),
        prompt,
        model.text_feed(prompt),
        codes,
        args.chunk,
    )
    np.savez(args.out, allow_pickle=False, **arrays, **extras)
    return 0


def _clone_for_dump(args: argparse.Namespace, model: Model) -> tuple[Voice, dict[str, np.ndarray]]:
    """The voice of --ref-audio/--ref-text and what the encoders saw and gave: ref_wav_24k,
    mel, x_vector and (in context) ref_codes."""
    from .cloning import VoiceEncoders
    from .model.reference import read_reference

    ref = read_reference(args.ref_audio, None, model.sample_rate)
    voice, mel = VoiceEncoders(model).encode(ref, args.ref_text)
    arrays = {"ref_wav_24k": ref.samples, "mel": mel, "x_vector": voice.x_vector}
    if voice.ref_codes is not None:
        arrays["ref_codes"] = voice.ref_codes
    return voice, arrays


def _dump_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "dump",
        help="teacher-forced outputs of every engine, for parity checks",
        description="Write prefill, trailing, talker_logits, talker_hidden, cp_logits, "
        "audio and audio_streamed for a prompt and a code sequence to an .npz file (with "
        "--ref-audio also ref_wav_24k, mel, x_vector, and with --ref-text ref_codes; audio is "
        "then what follows the reference).",
    )
    _add_model(p)
    p.add_argument("--text", required=True)
    _add_voice(p)
    _add_cloning(p)
    p.add_argument(
        "--text-streaming",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="streaming text feeding (default) or the whole text in the prefill",
    )
    p.add_argument("--codes", required=True, help=".npy file of integer codes [N, 16]")
    p.add_argument("--chunk", type=_positive, default=1, help="frames per decoder push for audio_streamed")
    _add_threads(p)
    p.add_argument("--out", required=True, help="output .npz")
    p.set_defaults(func=cmd_dump)
    return p


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import median, run_bench

    model = _model(args)
    voice = _voice(args, model)["voice"]
    runtime = _runtime(args, model, args.streams or 1)
    if args.streams:
        import trio

        from .bench import run_streams_bench

        figures = trio.run(run_streams_bench, runtime, args.frames, args.streams, args.repeat, voice)
        joined = (
            f", joining the others {figures['join_ttfa_s']:.3f} s, p95 {figures['join_ttfa_s_p95']:.3f} s"
            if "join_ttfa_s" in figures
            else ""
        )
        steady = (
            f"; {figures['steady_audio_s_per_s']:.3f}, {figures['steady_x_solo']:.2f}x,"
            " once all were heard and until one ended"
            if figures.get("steady_x_solo")
            else ""
        )
        against_solo = (
            f" ({figures['aggregate_x_solo']:.2f}x one stream's"
            f" {figures['solo_audio_s_per_s']:.3f} in the same rounds{steady})"
            if "aggregate_x_solo" in figures
            else ""
        )
        _report(
            f"{figures['streams']} streams of {figures['frames']} frames: "
            f"{figures['aggregate_audio_s_per_s']:.3f} s of audio per second in all{against_solo}, "
            f"RTF per stream {figures['rtf_per_stream']:.2f}; first audio p50 {figures['ttfa_s_p50']:.3f} s, "
            f"p95 {figures['ttfa_s_p95']:.3f} s (alone {figures['solo_ttfa_s']:.3f} s{joined}); "
            f"{_busy_line(figures)}, {figures['generator_ms_per_stream_frame']:.1f} and "
            f"{figures['decoder_ms_per_stream_frame']:.1f} ms a stream-frame; "
            f"peak RSS {figures['peak_rss_mb']:.0f} MB",
            figures,
            args.json,
        )
        return 0
    if args.pipeline:
        import trio

        from .bench import run_pipeline_bench

        bench = functools.partial(run_pipeline_bench, live=not args.offline)
        results, traces = trio.run(bench, runtime, args.frames, args.repeat, voice)
        if args.trace:
            Path(args.trace).write_text(json.dumps(traces if args.repeat > 1 else traces[0]))
        result = median(results)
        busy = sum(result["ms_per_frame"].values())
        overlap = statistics.median(t["overlap_s"] for t in traces)
        print(
            f"pipeline ({'as for a file' if args.offline else 'for a live listener'}): "
            f"{1000 * result['wall_s'] / result['frames']:.1f} ms wall per frame vs "
            f"{busy:.1f} ms of stage time; decoder/generator overlap {overlap:.2f} s; "
            f"{_busy_line(result)}",
            file=sys.stderr,
        )
    else:
        results = run_bench(runtime, args.frames, args.repeat, voice)
        result = median(results)
    if args.repeat > 1:
        ttfa = sorted(r["ttfa_s"] for r in results)
        print(
            f"medians of {args.repeat} runs; time to first audio from {ttfa[0]:.3f} to {ttfa[-1]:.3f} s",
            file=sys.stderr,
        )
    ms, floor, x = result["ms_per_frame"], result["floor_ms_per_frame"], result["x_floor"]
    compute = result["compute_floor_ms_per_frame"]
    _report(
        f"{result['frames']} frames, {result['audio_s']:.2f} s of audio in {result['wall_s']:.2f} s "
        f"(RTF {result['rtf']:.2f}), first audio after {result['ttfa_s']:.3f} s\n"
        f"per frame: talker {ms['talker']} ms, code predictor {ms['code_predictor']} ms, "
        f"decoder {ms['decoder']} ms; peak RSS {result['peak_rss_mb']:.0f} MB\n"
        f"this machine's floor: talker {floor['talker']} ms, code predictor "
        f"{floor['code_predictor']} ms, decoder {floor['decoder']} ms, RTF {result['floor_rtf']:.2f} "
        f"(measured / floor: {x['talker']}, {x['code_predictor']}, {x['decoder']}, RTF {x['rtf']}); "
        f"the decoder's products in a decode's order, weights from memory: "
        f"{result['decoder_products_in_order_ms']} ms; the products' arithmetic, weights in the "
        f"caches: talker {compute['talker']} ms, code predictor {compute['code_predictor']} ms",
        result,
        args.json,
    )
    return 0


def _busy_line(figures: dict[str, Any]) -> str:
    return f"threads busy: generator {figures['generator_busy']:.0%}, decoder {figures['decoder_busy']:.0%}"


def _report(summary: str, figures: dict[str, Any], as_json: bool) -> None:
    """The benchmark's summary for a reader (on stderr when stdout ends with the JSON object)."""
    print(summary, file=sys.stderr if as_json else sys.stdout)
    if as_json:
        print(json.dumps(figures))


def _bench_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="time to first audio, real-time factor, per-stage cost")
    _add_model(p)
    _add_voice_name(p)
    _add_cloning(p)
    p.add_argument(
        "--frames", type=_positive, default=40, help="frames to generate, EOS ignored (default 40)"
    )
    _add_threads(p)
    p.add_argument("--json", action="store_true", help="end stdout with one JSON object")
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="measure through the streaming actor pipeline (decoder overlapping)",
    )
    p.add_argument(
        "--offline",
        action="store_true",
        help="with --pipeline: speak as for a file (-o), the decoder holding frames back to push "
        "several at once; default: for a listener who hears the audio as it comes (--pipe)",
    )
    p.add_argument(
        "--repeat",
        type=_positive,
        default=1,
        help="run N utterances and report each figure's median (default 1)",
    )
    p.add_argument(
        "--trace",
        help="with --pipeline: write per-frame stage start/end times (JSON; a list of them with --repeat)",
    )
    p.add_argument(
        "--streams",
        type=_positive,
        help="run N utterances at once on one runtime (each exactly --frames frames) and report "
        "their time to first audio, RTF and aggregate throughput (with N > 1, against one stream "
        "alone after each round)",
    )
    p.set_defaults(func=cmd_bench)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    from .model.voice import VoiceLibrary
    from .server.app import serve
    from .server.voices import ServerVoices

    model = _model(args)
    voices = ServerVoices(model, VoiceLibrary(args.voices))
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    return serve(_server_runtime(args, model), voices, args.host, args.port, api_key, args.max_queue)


def _serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible speech server with a streaming WebSocket",
        description="Serve POST /v1/audio/speech (OpenAI's dialect), GET /v1/models, "
        "GET /v1/audio/voices, the WebSocket /v1/audio/speech/stream and /health.",
    )
    _add_model(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_at_least(0), default=8000, help="port (default 8000; 0: any free one)")
    p.add_argument("--api-key", help=f"require this bearer key on all routes but /health (or ${API_KEY_ENV})")
    p.add_argument(
        "--max-queue",
        type=_at_least(0),
        default=8,
        help="requests that may wait for the engines; more get 503 (default 8)",
    )
    _add_max_streams(p)
    _add_voices_dir(p)
    _add_threads(p)
    p.set_defaults(func=cmd_serve)
    return p


def cmd_wyoming(args: argparse.Namespace) -> int:
    from .model.voice import VoiceLibrary
    from .server.voices import ServerVoices
    from .server.wyoming import serve

    model = _model(args)
    voices = ServerVoices(model, VoiceLibrary(args.voices))
    return serve(_server_runtime(args, model), voices, args.uri)


def _wyoming_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("wyoming", help="a Wyoming text-to-speech server (Home Assistant)")
    _add_model(p)
    p.add_argument(
        "--uri", default="tcp://127.0.0.1:10200", help="where to listen (default tcp://127.0.0.1:10200)"
    )
    _add_voices_dir(p)
    _add_max_streams(p)
    _add_threads(p)
    p.set_defaults(func=cmd_wyoming)
    return p


SUBCOMMANDS: dict[str, Callable[[argparse._SubParsersAction], argparse.ArgumentParser]] = {
    "convert": _convert_parser,
    "voices": _voices_parser,
    "voice": _voice_parser,
    "dump": _dump_parser,
    "bench": _bench_parser,
    "serve": _serve_parser,
    "wyoming": _wyoming_parser,
}


def _voice(args: argparse.Namespace, model: Model) -> dict[str, Any]:
    """--voice (a built-in speaker, or a Base model's saved voice), or a voice cloned from
    --ref-audio [--ref-text]; --language and --instruct; as keyword arguments."""
    from .model.voice import VoiceLibrary

    voice: VoiceArg = args.voice
    ref_audio, ref_text = getattr(args, "ref_audio", None), getattr(args, "ref_text", None)
    if ref_text is not None and ref_audio is None:
        raise UsageError("--ref-text is the transcript of --ref-audio: give both")
    if ref_audio is not None:
        if args.voice is not None:
            raise UsageError("--voice or --ref-audio, not both")
        from .cloning import VoiceEncoders

        voice = VoiceEncoders(model).voice(ref_audio, ref_text=ref_text)
    elif args.voice is not None and model.kind == "base":
        voice = VoiceLibrary(args.voices).load(args.voice)
    return {
        "voice": voice,
        "language": getattr(args, "language", "auto"),
        "instruct": getattr(args, "instruct", None),
    }


def _add_voice(p: argparse.ArgumentParser) -> None:
    _add_voice_name(p)
    p.add_argument("--language", default="auto", help="language name, or auto (default)")
    p.add_argument("--instruct", help="a voice instruction (VoiceDesign, 1.7B CustomVoice)")


def _add_voice_name(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--voice", help="built-in speaker (default: the first), or a saved voice (Base; see `voices`)"
    )
    _add_voices_dir(p)


def _add_cloning(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ref-audio", help="Base models: speak in the voice of this recording (1-30 s)")
    p.add_argument("--ref-text", help="with --ref-audio: what it says (in-context cloning, closer)")


def speak_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kazeia-stream",
        description="Speak text with Qwen3-TTS, live.",
        epilog="subcommands: " + ", ".join(SUBCOMMANDS) + " (kazeia-stream SUBCOMMAND -h)",
    )
    p.add_argument("text", nargs="?", help="the text to speak")
    p.add_argument("-o", "--output", help="write the audio to this file (.wav, .flac) instead of playing it")
    p.add_argument(
        "--pipe",
        action="store_true",
        help="read UTF-8 text from stdin (a line is an utterance), write raw PCM to stdout",
    )
    p.add_argument(
        "--format", choices=FORMATS, default="s16le", help="--pipe PCM format, 24 kHz mono (default s16le)"
    )
    p.add_argument("--device", help="audio output device, by index or name (default: the system's)")
    _add_threads(p)
    _add_model(p)
    _add_voice(p)
    _add_cloning(p)
    p.add_argument("--seed", type=_at_least(0), help="random seed: the same seed gives the same audio")
    p.add_argument(
        "--text-streaming",
        action="store_true",
        help="with -o: feed the text one token per frame instead of all in the prefill "
        "(live modes always stream)",
    )
    _add_common(p)
    p.set_defaults(func=cmd_speak)
    return p


def subcommand_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kazeia-stream")
    sub = parser.add_subparsers(dest="command", required=True)
    for make in SUBCOMMANDS.values():
        _add_common(make(sub))
    return parser


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, stream=sys.stderr, format="kazeia-stream: %(message)s")
    # -v shows llama.cpp's errors (why it refused a file), -vv all of its log
    llama_level = logging.CRITICAL if verbose == 0 else logging.ERROR if verbose == 1 else logging.DEBUG
    logging.getLogger("llama.cpp").setLevel(llama_level)
    # gguf's writer logs each metadata header the code predictor builds at load
    logging.getLogger("gguf").setLevel(logging.DEBUG if verbose >= 2 else logging.WARNING)


_terminated = False


def _on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM stops the command as Ctrl-C does (trio handles SIGINT at a safe point; the file
    writer keeps the audio so far), then exits with 143. Both work however we were started: a
    shell without job control starts background commands with SIGINT ignored, which would
    leave SIGTERM nothing to stop (`main` catches SIGINT again)."""
    global _terminated
    _terminated = True
    os.kill(os.getpid(), signal.SIGINT)


def _user_facing(exc: BaseException) -> BaseException | None:
    """The interruption or our error inside `exc` (trio wraps what crosses its nurseries in
    exception groups), interruptions first; None for anything else (a bug: its traceback)."""
    for kind in (KeyboardInterrupt, KazeiaError):
        if isinstance(exc, kind):
            return exc
        if isinstance(exc, BaseExceptionGroup) and (group := exc.subgroup(kind)) is not None:
            return leaf(group)
    return None


def _standard_streams() -> None:
    """Open /dev/null on any of fds 0-2 that was closed when we started (Python's sys.stdin,
    sys.stdout or sys.stderr is then None): else the next file opened takes its number, and
    llama.cpp's log to fd 2 would go into it. Without a stderr our messages go nowhere (`print`
    to a None file writes to stdout: into `--pipe`'s PCM)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (the process's, as sys.stderr is)


def main(argv: Sequence[str] | None = None) -> int:
    _standard_streams()
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = subcommand_parser() if argv and argv[0] in SUBCOMMANDS else speak_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # trio's handler replaces only this
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return args.func(args)
    except BaseException as exc:
        error = _user_facing(exc)
        if isinstance(error, KeyboardInterrupt):
            print(f"kazeia-stream: {'terminated' if _terminated else 'interrupted'}", file=sys.stderr)
            return 143 if _terminated else 130
        if error is None:
            raise
        print(f"kazeia-stream: error: {error}", file=sys.stderr)
        return 1
    finally:
        _exiting()


def _exiting() -> None:
    """The command is done and the process only exits from here: a Ctrl-C or a SIGTERM that
    comes while the interpreter waits for threads to end (a server's workers finishing their
    frame) is ignored. It raised KeyboardInterrupt in that wait and printed a traceback after
    the Wyoming server's "stopped" (a second SIGINT, once in a clean-clone CI)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
