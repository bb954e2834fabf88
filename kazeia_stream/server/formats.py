"""Streaming audio encoders for the speech server's OpenAI `response_format`s.

The server hands 24 kHz float PCM chunks to an encoder as they are produced and sends the bytes
each `write` returns to the client at once, so a byte once returned is final: no encoder here
ever goes back to rewrite it, and what the client receives, concatenated, decodes.

- `pcm`: raw s16le mono, the same bytes as the CLI's `--pipe` (`pcm.pcm_bytes`: clip to
  [-1, 1], times 32767, round half to even).
- `wav`: a 44-byte RIFF/WAVE header for unknown length (the RIFF and data sizes 0xFFFFFFFF; as
  for a pipe, libsndfile and sox then take the length from the data), then the `pcm` bytes.
- `flac`, `mp3`, `opus` (Ogg Opus): libsndfile through soundfile, writing into `StreamSink`.

Those same s16 values go to libsndfile for FLAC (int16 in: lossless, equal to `pcm`), because
libsndfile's own float conversion is not the pipe's, nor even one rule: 1.2.2 stores
floor(x * 32768) for WAV/RAW PCM_16 and round(x * 32768) for FLAC.

What libsndfile 1.2.2 does with a writable file object (soundfile's virtual I/O), per format:

- FLAC writes its header at the first write (STREAMINFO with total samples 0, "unknown"), a
  frame per 4096 samples, and at close seeks back to fill in STREAMINFO's frame sizes, total
  samples and MD5. Those late rewrites are dropped: the stream is a valid streamed FLAC whose
  length is unknown (libsndfile and sox decode it, but soundfile needs `seekable()` false to
  read it to the end: libsndfile reports 2**63 - 1 frames and fails the seek soundfile makes
  after each read).
- MP3 (LAME) writes a placeholder Xing/LAME frame first (a frame header, then zeros) and at close
  seeks back to fill it in. The placeholder is cut from the stream, which is then byte for byte
  what libsndfile writes to a pipe (no tag). Constant bitrate: without the tag, decoders
  (libsndfile's mpg123 among them) take the length from the file size and the first frame's
  bitrate, which for VBR cuts the audio short. No tag also means no gapless trim: a decoder
  gives 1105 samples (LAME's 576 plus the decoder's 529) before the audio.
- Ogg Opus writes its two header pages at open and never seeks; it flushes a page a second by
  default, here every 50 ms (SFC_SET_OGG_PAGE_LATENCY_MS; less changes nothing). It decodes at
  24 kHz (OpusHead's input rate), pre-skip and end trimmed to the input's length.
- AAC: libsndfile has no AAC encoder.
"""

from __future__ import annotations

import logging
import struct

import numpy as np
import soundfile as sf

from ..errors import UsageError
from ..pcm import pcm_bytes

log = logging.getLogger(__name__)

FORMATS: dict[str, str] = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
SUPPORTED = ("mp3", "opus", "flac", "wav", "pcm")

_SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302  # sndfile.h; soundfile has no wrapper for it
_OGG_PAGE_LATENCY_MS = 50.0
_MP3_KBPS = 96  # constant bitrate, plenty for 24 kHz mono speech


class UnsupportedFormat(UsageError):
    """A `response_format` this server cannot encode."""


def _unsupported(fmt: str, why: str) -> UnsupportedFormat:
    return UnsupportedFormat(
        f"response_format {fmt!r} is not supported here ({why}); use {', '.join(SUPPORTED[:-1])} or pcm"
    )


def _s16(pcm: np.ndarray) -> np.ndarray:
    """The pipe's s16 samples of a float chunk (one conversion for pcm, wav and flac)."""
    return np.frombuffer(pcm_bytes(_mono(pcm), "s16le"), dtype="<i2")


def _mono(pcm: np.ndarray) -> np.ndarray:
    x = np.asarray(pcm, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError(f"expected mono samples of shape (n,), got shape {x.shape}")
    return x


class AudioEncoder:
    """One utterance's encoder: `write` each chunk, send what it returns, then send `finish()`."""

    content_type: str = "application/octet-stream"

    def __init__(self) -> None:
        self._closed = False

    def write(self, pcm: np.ndarray) -> bytes:
        """Encode float32 mono samples; returns the bytes now final (may be b"")."""
        self._check_open()
        return self._write(pcm)

    def finish(self) -> bytes:
        """The remaining bytes (codec flush, last page); the encoder is closed after it."""
        self._check_open()
        try:
            return self._finish()
        finally:
            self._closed = True

    def close(self) -> None:
        """Abandon the stream (the client went away): free the codec, drop what is left."""
        if not self._closed:
            self._closed = True
            self._abandon()

    @property
    def held_bytes(self) -> int:
        """Encoded bytes held back from the client (bounded: a frame at most)."""
        return 0

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the audio encoder is already finished")

    def _write(self, pcm: np.ndarray) -> bytes:
        raise NotImplementedError

    def _finish(self) -> bytes:
        return b""

    def _abandon(self) -> None:
        pass


class _RawEncoder(AudioEncoder):
    """pcm, and wav: the same bytes behind a header that says nothing of the length."""

    def __init__(self, header: bytes = b"") -> None:
        super().__init__()
        self._header = header

    def _write(self, pcm: np.ndarray) -> bytes:
        head, self._header = self._header, b""
        return head + _s16(pcm).tobytes()

    def _finish(self) -> bytes:
        head, self._header = self._header, b""
        return head


def wav_header(sample_rate: int) -> bytes:
    """RIFF/WAVE, PCM 16-bit mono, with the sizes of a stream of unknown length (0xFFFFFFFF)."""
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", 0xFFFFFFFF)
        + b"WAVEfmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + struct.pack("<I", 0xFFFFFFFF)
    )


class StreamSink:
    """The file object libsndfile writes into: bytes go to the client, and are never rewritten.

    It keeps libsndfile's idea of the position (seek, tell and the file's length work as in a
    real file) but holds only the bytes not yet taken. A write landing on bytes already taken
    (FLAC's STREAMINFO and the MP3 info tag, rewritten at close) is dropped and logged; one on
    bytes still held applies, so a stream finished before anything was taken gets it.
    """

    def __init__(self) -> None:
        self._held = bytearray()
        self._base = 0  # stream offset of the first held byte: everything before it is gone
        self._pos = 0
        self.dropped = 0  # bytes of late rewrites dropped

    @property
    def _end(self) -> int:
        return self._base + len(self._held)

    def write(self, data: bytes) -> int:
        data = bytes(data)
        size, start = len(data), self._pos
        if start < self._base:  # the part on bytes the client has
            cut = min(size, self._base - start)
            self.dropped += cut
            log.debug("dropped a %d-byte rewrite at offset %d of a streamed file", cut, start)
            data, start = data[cut:], start + cut
        if data:
            if start > self._end:  # past the end: a hole, as a file would read it
                self._held.extend(bytes(start - self._end))
            i = start - self._base
            self._held[i : i + len(data)] = data
        self._pos += size
        return size

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._end}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> bytes:
        return b""  # write-only: libsndfile does not read back what it encodes

    def take(self) -> bytes:
        """The held bytes: they are the client's from now on."""
        out = bytes(self._held)
        self._base += len(out)
        self._held.clear()
        return out

    def cut(self, n: int) -> None:
        """Drop the first `n` held bytes from the stream (MP3's info-tag placeholder)."""
        del self._held[:n]
        self._base += n

    def peek(self, n: int) -> bytes:
        return bytes(self._held[:n])

    @property
    def held(self) -> int:
        return len(self._held)


_MP3_KBPS_TABLE = {
    3: (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),  # MPEG-1 layer III
    2: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),  # MPEG-2 and 2.5
}
_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}


def mp3_frame_length(header: bytes) -> int | None:
    """The length in bytes of the MPEG layer III frame starting with `header`, None if not one."""
    if len(header) < 4 or header[0] != 0xFF or header[1] & 0xE0 != 0xE0:
        return None
    version, layer = (header[1] >> 3) & 3, (header[1] >> 1) & 3
    rate_index, padding = (header[2] >> 2) & 3, (header[2] >> 1) & 1
    kbps_index = header[2] >> 4
    if layer != 1 or version == 1 or rate_index == 3 or kbps_index in (0, 15):
        return None
    kbps = _MP3_KBPS_TABLE[3 if version == 3 else 2][kbps_index]
    per_frame = 144 if version == 3 else 72  # samples per frame / 8
    return per_frame * kbps * 1000 // _MP3_RATES[version][rate_index] + padding


def _mp3_compression(sample_rate: int, kbps: int) -> float:
    """libsndfile's compression level for a constant `kbps` (it maps the level linearly onto
    the MPEG version's bitrate range, then truncates: aim half a kbps above)."""
    top, bottom = (320, 32) if sample_rate >= 32000 else (160, 8) if sample_rate >= 16000 else (64, 8)
    kbps = min(max(kbps, bottom), top)
    return min(max((top - kbps - 0.5) / (top - bottom), 0.0), 1.0)


_CONTAINERS = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}


class _SoundFileEncoder(AudioEncoder):
    """flac, mp3 and opus: libsndfile encodes into a `StreamSink`; each call takes its output."""

    def __init__(self, fmt: str, sample_rate: int) -> None:
        super().__init__()
        self._fmt = fmt
        self._sink = StreamSink()
        self._tag_pending = fmt == "mp3"  # LAME's placeholder info frame, still to cut
        self._samples = 0
        container, subtype = _CONTAINERS[fmt]
        mp3 = fmt == "mp3"
        try:
            self._file = sf.SoundFile(
                self._sink,
                mode="w",
                samplerate=sample_rate,
                channels=1,
                format=container,
                subtype=subtype,
                bitrate_mode="CONSTANT" if mp3 else None,
                compression_level=_mp3_compression(sample_rate, _MP3_KBPS) if mp3 else None,
            )
        except (sf.LibsndfileError, ValueError) as e:
            raise _unsupported(fmt, f"libsndfile cannot encode it at {sample_rate} Hz: {e}") from None
        if fmt == "opus":
            self._set_page_latency(_OGG_PAGE_LATENCY_MS)

    def _set_page_latency(self, ms: float) -> None:
        """Ogg pages every `ms` instead of every second, so Opus streams as it is produced."""
        try:
            from soundfile import _ffi, _snd

            latency = _ffi.new("double*", ms)
            _snd.sf_command(self._file._file, _SFC_SET_OGG_PAGE_LATENCY_MS, latency, _ffi.sizeof("double"))
        except (ImportError, AttributeError) as e:  # another soundfile: pages every second
            log.warning("cannot set the Ogg page latency (%s); Opus will come in 1 s pages", e)

    def _write(self, pcm: np.ndarray) -> bytes:
        x = _s16(pcm) if self._fmt == "flac" else np.clip(_mono(pcm), -1.0, 1.0)
        if len(x):
            try:
                self._file.write(x)
            except sf.LibsndfileError as e:
                raise RuntimeError(f"{self._fmt} encoder failed: {e}") from None
            self._samples += len(x)
        return self._take()

    def _finish(self) -> bytes:
        # without audio libsndfile writes no FLAC or MP3 header and no last Ogg page: one
        # silent sample makes the response a valid (silent) file
        head = b"" if self._samples else self._write(np.zeros(1, np.float32))
        self._file.close()  # flushes the codec; its seeks back at close land on taken bytes
        if self._sink.dropped:
            log.debug("%s stream: %d header bytes left as first sent", self._fmt, self._sink.dropped)
        return head + self._take(final=True)

    def _abandon(self) -> None:
        self._file.close()

    def _take(self, final: bool = False) -> bytes:
        if self._tag_pending:
            size = mp3_frame_length(self._sink.peek(4))
            if size is None or self._sink.held < size:
                # the first frame is not all here yet; at the end, there is no tag to cut
                return self._sink.take() if final else b""
            frame = self._sink.peek(size)
            # the placeholder (zeros), or the tag itself if nothing was taken before close
            if not any(frame[4:]) or b"Xing" in frame or b"Info" in frame:
                self._sink.cut(size)
            self._tag_pending = False
        return self._sink.take()

    @property
    def held_bytes(self) -> int:
        return self._sink.held


def check_format(fmt: str) -> str:
    """The format's name, if this server encodes it; UnsupportedFormat for aac or an unknown name."""
    name = fmt.lower()
    if name == "aac":
        raise _unsupported(fmt, "libsndfile has no AAC encoder")
    if name not in SUPPORTED:
        raise _unsupported(fmt, "unknown format")
    return name


def open_encoder(fmt: str, sample_rate: int) -> AudioEncoder:
    """An encoder for `response_format` `fmt` (see `check_format`)."""
    name = check_format(fmt)
    encoder: AudioEncoder
    if name == "pcm":
        encoder = _RawEncoder()
    elif name == "wav":
        encoder = _RawEncoder(wav_header(sample_rate))
    else:
        encoder = _SoundFileEncoder(name, sample_rate)
    encoder.content_type = FORMATS[name]
    return encoder
