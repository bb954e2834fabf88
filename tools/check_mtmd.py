#!/usr/bin/env python3
"""Check that llama.cpp's mtmd accepts a Qwen3-TTS mmproj GGUF: print OK or the error.

mtmd needs the talker too (it checks the hidden sizes agree); by default the talker is found
beside the mmproj by dropping the `mmproj-` prefix of its name. With --run, it also runs one
code-predictor step (GEN_CODE, from a zero hidden state) and decodes the resulting frame to audio
(GEN_WAV), which executes every codec kernel, e.g. to check that mtmd computes with F32 conv
kernels.

Note: mtmd only opens an mmproj that has a speaker encoder (Base models); the code2wav sizes are
hard-coded in clip.cpp, so tiny test models do not load either.

Usage: python tools/check_mtmd.py [--talker TALKER] [--run] MMPROJ
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import llama_cpp
from llama_cpp import mtmd_cpp

GGML_LOG_LEVEL_ERROR = 4


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mmproj", type=Path)
    ap.add_argument("--talker", type=Path, help="talker GGUF (default: MMPROJ's name without 'mmproj-')")
    ap.add_argument("--run", action="store_true", help="also run one GEN_CODE and one GEN_WAV step")
    args = ap.parse_args(argv)
    talker = args.talker or args.mmproj.with_name(args.mmproj.name.removeprefix("mmproj-"))

    errors: list[str] = []

    @llama_cpp.llama_log_callback
    def log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
        if level == GGML_LOG_LEVEL_ERROR:
            errors.append(text.decode(errors="replace").strip())

    llama_cpp.llama_log_set(log, None)
    mtmd_cpp.mtmd_log_set(log, None)
    llama_cpp.llama_backend_init()

    def fail(what: str) -> int:
        print(f"ERROR: {what}")
        for line in errors:
            print(f"  {line}")
        return 1

    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(talker).encode(), params)
    if not model:
        return fail(f"{talker}: libllama cannot load the talker")
    ctx_params = mtmd_cpp.mtmd_context_params_default()
    ctx_params.use_gpu = False
    ctx_params.warmup = False
    ctx = mtmd_cpp.mtmd_init_from_file(str(args.mmproj).encode(), model, ctx_params)
    try:
        if not ctx:
            return fail(f"{args.mmproj}: mtmd cannot load the mmproj")
        if args.run and not _run(ctx, llama_cpp.llama_model_n_embd(model)):
            return fail(f"{args.mmproj}: mtmd cannot run it")
        print("OK")
        return 0
    finally:
        if ctx:
            mtmd_cpp.mtmd_free(ctx)
        llama_cpp.llama_model_free(model)


def _run(ctx: mtmd_cpp.mtmd_context_p, n_embd: int) -> bool:
    """One GEN_CODE step, then GEN_WAV on the frame it produced."""
    hidden = (ctypes.c_float * n_embd)()
    inp = mtmd_cpp.mtmd_gen_inp_default(ctx)
    inp.type = mtmd_cpp.MTMD_GEN_PROCESS_TYPE_GEN_CODE
    inp.code0 = 0
    inp.embd = hidden
    inp.seed = 0
    out = mtmd_cpp.mtmd_gen_out()
    if mtmd_cpp.mtmd_gen_audio_process(ctx, ctypes.byref(inp), ctypes.byref(out)) != 0:
        return False
    codes = (ctypes.c_int32 * out.n_codes)(*out.codes[: out.n_codes])
    print(f"GEN_CODE: codes {list(codes)}")

    inp = mtmd_cpp.mtmd_gen_inp_default(ctx)
    inp.type = mtmd_cpp.MTMD_GEN_PROCESS_TYPE_GEN_WAV
    inp.codes = codes
    inp.n_codes = len(codes)
    inp.seed = 0
    out = mtmd_cpp.mtmd_gen_out()
    if mtmd_cpp.mtmd_gen_audio_process(ctx, ctypes.byref(inp), ctypes.byref(out)) != 0:
        return False
    audio = out.audio[: out.n_samples]
    rms = (sum(x * x for x in audio) / max(len(audio), 1)) ** 0.5
    print(f"GEN_WAV: {out.n_samples} samples, rms {rms:.4f}")
    return True


if __name__ == "__main__":
    sys.exit(main())
