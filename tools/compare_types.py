"""How far a quantized model drifts from a reference conversion of the same checkpoint.

    python tools/compare_types.py REF_MODEL OTHER_MODEL [--frames 40] [--text TEXT]

Both models speak the same text greedily (no sampling) for exactly N frames. Reported:
- teacher-forced agreement: along the reference's codes, how often the other model's talker and
  code predictor pick the same code (argmax), and their largest logit difference;
- free-running drift: the first frame where the greedy codes differ, and the share of equal codes;
- the audio: SNR of the other model's audio against the reference's.
"""

from __future__ import annotations

import argparse

import numpy as np

import kazeia_stream
from kazeia_stream.engine.dump import teacher_forced_talker

TEXT = "The quick brown fox jumps over the lazy dog, and then it rests in the warm afternoon sun."


def greedy_codes(model: kazeia_stream.Model, text: str, frames: int) -> tuple[np.ndarray, np.ndarray]:
    from kazeia_stream.engine.generator import GenerationOptions
    from kazeia_stream.engine.synthesis import frames as frame_iter

    prompt = model.prompt(text, voice=model.default_voice, text_streaming=True)
    opts = GenerationOptions(seed=0, do_sample=False, subtalker_do_sample=False,
                             max_frames=frames, ignore_eos=True)
    codes = np.stack(list(frame_iter(model.engines, prompt, opts)))
    return codes, model.engines.codec.decode(codes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference")
    ap.add_argument("other")
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--text", default=TEXT)
    args = ap.parse_args()
    ref, other = kazeia_stream.load_model(args.reference), kazeia_stream.load_model(args.other)

    codes, audio = greedy_codes(ref, args.text, args.frames)
    prompt_r = ref.prompt(args.text, voice=ref.default_voice)
    prompt_o = other.prompt(args.text, voice=other.default_voice)
    lr, hr = teacher_forced_talker(ref.engines, prompt_r, codes)
    lo, ho = teacher_forced_talker(other.engines, prompt_o, codes)
    cp_r = np.stack([ref.engines.code_predictor.teacher_forced_logits(h, c) for h, c in zip(hr, codes)])
    cp_o = np.stack([other.engines.code_predictor.teacher_forced_logits(h, c) for h, c in zip(ho, codes)])
    print(f"teacher-forced talker: argmax agreement {np.mean(lr.argmax(-1) == lo.argmax(-1)):.3f}, "
          f"max |logit diff| {np.abs(lr - lo).max():.4f}")
    print(f"teacher-forced code predictor: argmax agreement {np.mean(cp_r.argmax(-1) == cp_o.argmax(-1)):.3f}, "
          f"max |logit diff| {np.abs(cp_r - cp_o).max():.4f}")

    codes_o, audio_o = greedy_codes(other, args.text, args.frames)
    same = codes == codes_o
    diverge = int(np.argmin(same.all(axis=1))) if not same.all() else args.frames
    snr = 10 * np.log10(np.sum(audio ** 2) / max(np.sum((audio - audio_o) ** 2), 1e-30))
    print(f"free-running greedy: codes equal {same.mean():.3f} (codebook 0: {same[:, 0].mean():.3f}), "
          f"first differing frame {diverge} of {args.frames}; audio SNR {snr:.1f} dB")


if __name__ == "__main__":
    main()
