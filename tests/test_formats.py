"""The speech server's streaming encoders (`response_format`): what a client receives, as it is
sent, decodes to the input; nothing is held back or rewritten; aac and unknown names are refused."""

from __future__ import annotations

import io
import struct
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
from decoding import decode

from kazeia_stream.errors import UsageError
from kazeia_stream.pcm import pcm_bytes
from kazeia_stream.server.formats import (
    FORMATS,
    StreamSink,
    UnsupportedFormat,
    mp3_frame_length,
    open_encoder,
)

RATE = 24000
CHUNK = 1920  # the server's 80 ms chunks
MP3_FRAME = 576  # samples per MPEG-2 layer III frame (24 kHz)


def signal(seconds: float, seed: int = 0) -> np.ndarray:
    """Two sweeping sines under a slow envelope, plus a little noise: speech-like in level and
    band, and not periodic, so aligning a decoded copy has one answer."""
    rng = np.random.default_rng(seed)
    n = int(RATE * seconds)
    t = np.arange(n) / RATE
    envelope = 0.6 + 0.4 * np.sin(2 * np.pi * 3 * t)
    low = 0.3 * np.sin(2 * np.pi * (200 * t + 60 * t**2))
    high = 0.15 * np.sin(2 * np.pi * (1500 * t - 100 * t**2))
    return (envelope * (low + high) + 0.01 * rng.standard_normal(n)).astype(np.float32)


def encode(fmt: str, x: np.ndarray) -> tuple[list[bytes], bytes]:
    """What `write` returns for each chunk, and what `finish` returns."""
    encoder = open_encoder(fmt, RATE)
    parts = [encoder.write(x[i : i + CHUNK]) for i in range(0, len(x), CHUNK)]
    return parts, encoder.finish()


def quantized(x: np.ndarray) -> np.ndarray:
    """The s16 samples the CLI's `--pipe` writes for `x`."""
    return np.frombuffer(pcm_bytes(x, "s16le"), dtype="<i2")


def lag(decoded: np.ndarray, x: np.ndarray, most: int = 4000) -> int:
    """How many samples later `x` starts in `decoded` (-most..most), by cross-correlation."""
    size = 1 << (len(decoded) + len(x)).bit_length()
    c = np.fft.irfft(np.fft.rfft(decoded, size) * np.conj(np.fft.rfft(x, size)), size)
    lags = np.r_[np.arange(-most, 0), np.arange(0, most)]
    return int(lags[np.argmax(c[lags])])


@pytest.mark.parametrize("fmt", ["pcm", "wav", "flac"])
def test_lossless_formats_decode_to_the_pipes_samples(fmt: str) -> None:
    x = signal(3.03)  # not a whole number of chunks
    x[100:110] = [1.5, -1.5, 1.0, -1.0, 0.5 / 32767, -0.5 / 32767, 2.5 / 32767, 0, 1e-9, -1e-9]
    parts, tail = encode(fmt, x)
    data = b"".join(parts) + tail
    want = quantized(x)
    if fmt == "pcm":
        got = np.frombuffer(data, dtype="<i2")
        assert data == pcm_bytes(x, "s16le")  # the pipe's bytes, chunked or not
    else:
        got, rate, channels = decode(data, "int16")
        assert (rate, channels) == (RATE, 1)
        assert sf.info(io.BytesIO(data)).subtype == "PCM_16"
    assert len(got) == len(x)
    np.testing.assert_array_equal(got, want)
    assert got[100:104].tolist() == [32767, -32767, 32767, -32767]  # clipped, times 32767


def test_wav_header_is_for_a_stream_of_unknown_length() -> None:
    x = signal(1.0)
    parts, tail = encode("wav", x)
    data = b"".join(parts) + tail
    riff, riff_size, wave, fmt_id, fmt_size = struct.unpack("<4sI4s4sI", data[:20])
    tag, channels, rate, byte_rate, block, bits = struct.unpack("<HHIIHH", data[20:36])
    data_id, data_size = struct.unpack("<4sI", data[36:44])
    assert (riff, wave, fmt_id, data_id) == (b"RIFF", b"WAVE", b"fmt ", b"data")
    assert (riff_size, data_size) == (0xFFFFFFFF, 0xFFFFFFFF)
    assert (fmt_size, tag, channels, rate, byte_rate, block, bits) == (16, 1, 1, RATE, 2 * RATE, 2, 16)
    assert len(parts[0]) == 44 + 2 * CHUNK  # the header goes out with the first chunk
    # libsndfile takes the length from the data, whether or not it may seek
    samples, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == RATE
    np.testing.assert_array_equal(samples, quantized(x))


@pytest.mark.parametrize(("fmt", "delay"), [("mp3", (1000, 1200)), ("opus", (0, 0))])
def test_lossy_formats_decode_close_to_the_input(fmt: str, delay: tuple[int, int]) -> None:
    """Measured (libsndfile 1.2.2, LAME 3.100, libopus 1.4): MP3 starts 1105 samples late (LAME's
    576 plus the decoder's 529; no info tag, so no gapless trim) and ends on a whole frame; Opus
    comes back at 24 kHz (OpusHead's input rate), pre-skip and end trimmed: exactly the input."""
    x = signal(4.03)
    parts, tail = encode(fmt, x)
    decoded, rate, channels = decode(b"".join(parts) + tail)
    assert (rate, channels) == (RATE, 1)
    k = lag(decoded, x)
    assert delay[0] <= k <= delay[1]
    after = len(decoded) - k - len(x)  # the codec's padding at the end
    if fmt == "mp3":
        assert 0 <= after < MP3_FRAME and len(decoded) % MP3_FRAME == 0
    else:
        assert len(decoded) == len(x)
    aligned = decoded[k : k + len(x)]
    assert np.corrcoef(aligned, x)[0, 1] > 0.95  # measured: MP3 0.9998, Opus 0.995


def test_mp3_has_no_placeholder_frame_and_reads_as_a_plain_file() -> None:
    """LAME's first frame is an empty Xing/Info tag that libsndfile fills in at close by seeking
    back; it is cut, so the stream starts on audio, and at a constant bitrate any reader (here
    soundfile's plain `sf.read`, which trusts the length estimate) gets it all."""
    x = signal(2.0)
    parts, tail = encode("mp3", x)
    data = b"".join(parts) + tail
    sizes = []
    while sum(sizes) < len(data):  # nothing but whole frames, end to end
        size = mp3_frame_length(data[sum(sizes) : sum(sizes) + 4])
        assert size is not None
        sizes.append(size)
    assert sum(sizes) == len(data)
    assert set(sizes) == {288}  # constant 96 kbps at 24 kHz: 72 * 96000 / 24000 bytes a frame
    assert any(data[4:288]) and b"Xing" not in data[:288] and b"Info" not in data[:288]
    decoded, rate = sf.read(io.BytesIO(data))
    assert rate == RATE and len(decoded) >= len(x) + 1000


@pytest.mark.parametrize("fmt", ["flac", "mp3", "opus"])
def test_compressed_formats_stream_while_they_are_written(fmt: str) -> None:
    """Bytes come out of `write` during the utterance, and what was sent after 2 s already
    decodes to most of those 2 s (a frame or a page behind)."""
    x = signal(4.0)
    parts, tail = encode(fmt, x)
    two_seconds = 2 * RATE // CHUNK
    sent = b"".join(parts[:two_seconds])
    assert len(sent) > 0
    assert sum(map(len, parts[two_seconds:])) > 4 * len(tail)  # most of it not left for finish()
    assert sum(1 for p in parts if p) >= len(parts) // 3  # FLAC: a frame per 4096 samples
    decoded, rate, _ = decode(sent)
    assert rate == RATE and len(decoded) > 1.8 * RATE
    # the first audio is out within 3 chunks (FLAC: its first 4096-sample frame; measured MP3 and
    # Opus: after the first chunk, as Ogg pages go out every 50 ms rather than every second)
    early, _, _ = decode(b"".join(parts[:3]))
    assert len(early) >= 576


@pytest.mark.parametrize("fmt", ["aac", "ogg-xyz", "AAC", ""])
def test_unsupported_formats_are_refused_in_one_line(fmt: str) -> None:
    with pytest.raises(UnsupportedFormat) as err:
        open_encoder(fmt, RATE)
    message = str(err.value)
    assert isinstance(err.value, UsageError)
    assert "\n" not in message and repr(fmt) in message
    assert message.endswith("use mp3, opus, flac, wav or pcm")
    if fmt.lower() == "aac":
        assert "no AAC encoder" in message


def test_content_types() -> None:
    assert set(FORMATS) == {"pcm", "wav", "flac", "mp3", "opus", "aac"}
    assert FORMATS["mp3"] == "audio/mpeg" and FORMATS["pcm"] == "audio/pcm"
    for fmt in ("pcm", "wav", "flac", "mp3", "opus"):
        assert open_encoder(fmt, RATE).content_type == FORMATS[fmt]


# A minute of audio through an encoder, in a process of its own: after other tests, one
# allocation of 1.9 MB, made once per process under soundfile's write and kept (no Python
# container; not traced further), fell inside the measured minute, when earlier tests decide.
_MINUTE = """
import sys, tracemalloc
import numpy as np
from kazeia_stream.server.formats import open_encoder
fmt, path, rate, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
x = np.load(path)
encoder = open_encoder(fmt, rate)
encoder.write(x[:chunk])  # headers and libsndfile's first allocations out of the way
tracemalloc.start()
start, held = tracemalloc.get_traced_memory()[0], 0
for i in range(1, 60 * rate // chunk):
    j = (i * chunk) % (len(x) - chunk)
    encoder.write(x[j : j + chunk])
    held = max(held, encoder.held_bytes)
now, peak = tracemalloc.get_traced_memory()
encoder.finish()
print(held, now - start, peak - start)
"""


@pytest.mark.parametrize("fmt", ["pcm", "wav", "flac", "mp3", "opus"])
def test_memory_stays_bounded_over_a_minute(fmt: str, tmp_path) -> None:
    """A minute of audio (2.9 MB as PCM) goes through without the encoder keeping it."""
    np.save(tmp_path / "x.npy", signal(4.0))
    argv = [sys.executable, "-c", _MINUTE, fmt, str(tmp_path / "x.npy"), str(RATE), str(CHUNK)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    held, grown, peak = map(int, out.split())
    assert held <= 4096
    assert grown < 64 * 1024 and peak < 256 * 1024


@pytest.mark.parametrize("fmt", ["pcm", "wav", "flac", "mp3", "opus"])
def test_finish_closes_and_an_empty_utterance_is_a_valid_file(fmt: str) -> None:
    """Without audio libsndfile would write no FLAC or MP3 header, and no last Ogg page: the
    encoder gives them one silent sample."""
    encoder = open_encoder(fmt, RATE)
    data = encoder.finish()
    with pytest.raises(ValueError, match="finished"):
        encoder.write(np.zeros(CHUNK, np.float32))
    with pytest.raises(ValueError, match="finished"):
        encoder.finish()
    if fmt == "pcm":
        assert data == b""
    else:
        decoded, rate, _ = decode(data)
        assert rate == RATE and len(decoded) <= 3 * MP3_FRAME and np.all(np.abs(decoded) < 1e-3)


def test_close_abandons_the_stream() -> None:
    encoder = open_encoder("opus", RATE)
    encoder.write(signal(0.5))
    encoder.close()
    encoder.close()
    with pytest.raises(ValueError):
        encoder.finish()


def test_the_sink_never_rewrites_bytes_already_taken() -> None:
    sink = StreamSink()
    assert sink.write(b"header....") == 10
    assert sink.write(b"frame") == 5
    assert sink.take() == b"header....frame"
    sink.seek(0, io.SEEK_END)
    assert sink.tell() == 15  # as a file: soundfile measures the length this way
    sink.seek(2)
    assert sink.write(b"XXXX") == 4  # a header rewrite at close: dropped
    assert sink.tell() == 6 and sink.dropped == 4
    sink.seek(15)
    sink.write(b"tail")
    sink.seek(13)
    sink.write(b"ZZZ")  # two bytes on taken ones, one on held ones
    assert sink.take() == b"Zail"
    assert sink.read(10) == b""
