"""How far a quantized model drifts from a reference conversion of the same checkpoint.

    python tools/compare_types.py REF_MODEL OTHER_MODEL [--frames 40] [--text TEXT]

Both models speak the same text greedily (no sampling) for exactly N frames. Reported:
- teacher-forced agreement: along the reference's codes, how often the other model's talker and
  code predictor pick the same code (argmax), the mean KL divergence of their distributions
  from the reference's, KL(ref || other) in nats, and their largest logit difference;
- free-running drift: the first frame where the greedy codes differ, and the share of equal codes;
- the audio: SNR of the other model's audio against the reference's.
"""

from __future__ import annotations

import argparse

import numpy as np

import kazeia_stream
from kazeia_stream.engine.dump import teacher_forced_talker
from kazeia_stream.engine.frames import GenerationOptions

TEXT = "The quick brown fox jumps over the lazy dog, and then it rests in the warm afternoon sun."


def greedy_codes(runtime: kazeia_stream.Runtime, text: str, frames: int) -> tuple[np.ndarray, np.ndarray]:
    model = runtime.model
    prompt = model.prompt(text, voice=model.default_voice, text_streaming=True)
    opts = GenerationOptions(
        seed=0, do_sample=False, subtalker_do_sample=False, max_frames=frames, ignore_eos=True
    )
    state = runtime.frames.start(prompt, model.text_feed(prompt), opts, np.random.default_rng(0))
    codes = []
    while (frame := runtime.frames.next_frame(state)) is not None:
        codes.append(frame)
    runtime.frames.finish(state)
    return np.stack(codes), runtime.codec.decode(np.stack(codes))


def teacher_forced(
    runtime: kazeia_stream.Runtime, text: str, codes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Talker logits [N, vocab] and code predictor logits [N, 15, vocab] along `codes`."""
    model = runtime.model
    prompt = model.prompt(text, voice=model.default_voice)
    logits, hidden = teacher_forced_talker(
        runtime.talker, runtime.code_predictor, prompt, model.text_feed(prompt), codes
    )
    cp = np.stack([runtime.code_predictor.teacher_forced_logits(h, c) for h, c in zip(hidden, codes)])
    return logits, cp


def mean_kl(ref: np.ndarray, other: np.ndarray) -> float:
    """Mean KL(softmax(ref) || softmax(other)) over the rows (last axis: the vocabulary), nats."""
    lp, lq = (x.astype(np.float64) - x.max(-1, keepdims=True) for x in (ref, other))
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
    return float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=-1)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference")
    ap.add_argument("other")
    ap.add_argument("--frames", type=int, default=40)
    ap.add_argument("--text", default=TEXT)
    args = ap.parse_args()
    ref, other = (
        kazeia_stream.Runtime(kazeia_stream.load_model(path)) for path in (args.reference, args.other)
    )

    codes, audio = greedy_codes(ref, args.text, args.frames)
    lr, cp_r = teacher_forced(ref, args.text, codes)
    lo, cp_o = teacher_forced(other, args.text, codes)
    for name, r, o in (("talker", lr, lo), ("code predictor", cp_r, cp_o)):
        print(
            f"teacher-forced {name}: argmax agreement {np.mean(r.argmax(-1) == o.argmax(-1)):.3f}, "
            f"mean KL {mean_kl(r, o):.5f} nats, max |logit diff| {np.abs(r - o).max():.4f}"
        )

    codes_o, audio_o = greedy_codes(other, args.text, args.frames)
    same = codes == codes_o
    diverge = int(np.argmin(same.all(axis=1))) if not same.all() else args.frames
    snr = 10 * np.log10(np.sum(audio**2) / max(np.sum((audio - audio_o) ** 2), 1e-30))
    print(
        f"free-running greedy: codes equal {same.mean():.3f} (codebook 0: {same[:, 0].mean():.3f}), "
        f"first differing frame {diverge} of {args.frames}; audio SNR {snr:.1f} dB"
    )


if __name__ == "__main__":
    main()
