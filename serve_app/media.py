"""Media URLs -> bytes -> images, under the server's fetch policy.

Owns where a media item may come from (vLLM's flags and defaults):
- `data:` URLs (base64), always;
- `http(s)://` URLs, fetched by the ingress with a timeout and a size limit, following at most
  `MAX_REDIRECTS` redirects, each hop checked again. Addresses that are private, loopback,
  link-local, multicast or reserved are refused unless `--allow-private-media-urls`; the check
  runs inside the connection's own name resolution (a resolver the connector uses), so a name
  that resolves to a public address for a check and a private one for the connection
  (DNS rebinding) cannot pass. `--allowed-media-domains` limits the hosts (and their
  subdomains);
- `file://` URLs, only under `--allowed-local-media-path`.
Decoding checks an image's size (an audio clip's or a video's duration) from its header before
decoding it, so a small file that expands to a huge image (a decompression bomb) is refused
cheaply. Videos (any container and codec FFmpeg reads, through PyAV) are sampled at a given rate,
as Qwen2-VL's video processor samples them: only the sampled frames are kept. Audio (wav, mp3,
flac, ogg: libsndfile through soundfile) is mixed to mono and resampled to the model's rate
(soxr)."""

from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import socket
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import soundfile
import soxr
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver
from PIL import Image, UnidentifiedImageError

from serve_app.errors import APIError

MAX_REDIRECTS = 3
MAX_ASPECT_RATIO = 200  # as Qwen2-VL's processor


@dataclass(frozen=True)
class MediaPolicy:
    allowed_domains: tuple[str, ...] | None = None  # None: any host
    allow_private: bool = False
    allowed_local_path: Path | None = None  # None: no file:// URLs
    timeout_s: float = 10.0
    max_bytes: int = 20 * 2**20
    max_pixels: int = 4096 * 4096


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


class _CheckedResolver(AbstractResolver):
    """The connector's resolver: every address a connection may use is checked here."""

    def __init__(self) -> None:
        self._inner = DefaultResolver()

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        refused = [r["host"] for r in results if not _public(r["host"])]
        if refused:
            raise _PrivateAddress(f"{host} resolves to a non-public address ({refused[0]})")
        return results

    async def close(self) -> None:
        await self._inner.close()


class _PrivateAddress(OSError):
    pass


class MediaFetcher:
    """One HTTP session for the ingress's media fetches."""

    def __init__(self, policy: MediaPolicy) -> None:
        self.policy = policy
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                resolver=None if self.policy.allow_private else _CheckedResolver(), limit=64)
            self._session = aiohttp.ClientSession(
                connector=connector, trust_env=False,
                timeout=aiohttp.ClientTimeout(total=self.policy.timeout_s))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def load(self, url: str, param: str) -> bytes:
        """The bytes `url` names, or a 400 naming `param`."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self._data_url(url, param)
        if scheme in ("http", "https"):
            return await self._fetch(url, param)
        if scheme == "file":
            return self._local(url, param)
        raise APIError("a media URL must be a data:, http(s):// or file:// URL", param=param)

    def _data_url(self, url: str, param: str) -> bytes:
        header, sep, payload = url[5:].partition(",")
        if not sep or not header.endswith(";base64"):
            raise APIError("a data: URL must be base64 (data:<type>;base64,<data>)", param=param)
        if len(payload) * 3 // 4 > self.policy.max_bytes:
            raise APIError(f"the media item is larger than {self.policy.max_bytes} bytes",
                           param=param)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise APIError("the data: URL is not valid base64", param=param) from None

    def _check_host(self, url: str, param: str) -> None:
        host = (urllib.parse.urlsplit(url).hostname or "").lower().rstrip(".")
        if not host:
            raise APIError("the media URL has no host", param=param)
        if not self.policy.allow_private:
            # an address literal never reaches the resolver, so it is checked here
            try:
                literal = _public(host.strip("[]"))
            except ValueError:
                literal = True  # a name: the connector's resolver checks its addresses
            if not literal:
                raise _PrivateAddress(f"{host} is not a public address")
        domains = self.policy.allowed_domains
        if domains is not None and not any(host == d or host.endswith("." + d) for d in domains):
            raise APIError(f"media from {host} is refused: not among --allowed-media-domains",
                           param=param)

    async def _fetch(self, url: str, param: str) -> bytes:
        limit = self.policy.max_bytes
        try:
            for _ in range(MAX_REDIRECTS + 1):
                self._check_host(url, param)
                async with self._client().get(url, allow_redirects=False) as response:
                    if response.status in (301, 302, 303, 307, 308):
                        location = response.headers.get("Location")
                        if not location:
                            break
                        url = urllib.parse.urljoin(url, location)
                        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
                            raise APIError("a media URL redirected to a non-HTTP URL",
                                           param=param)
                        continue
                    if response.status != 200:
                        raise APIError(f"fetching the media URL gave HTTP {response.status}",
                                       param=param)
                    if (response.content_length or 0) > limit:
                        raise APIError(f"the media item is larger than {limit} bytes",
                                       param=param)
                    data = bytearray()
                    async for chunk in response.content.iter_chunked(1 << 16):
                        data += chunk
                        if len(data) > limit:
                            raise APIError(f"the media item is larger than {limit} bytes",
                                           param=param)
                    return bytes(data)
            raise APIError(f"the media URL redirected more than {MAX_REDIRECTS} times",
                           param=param)
        except APIError:
            raise
        except TimeoutError:
            raise APIError(f"fetching the media URL took longer than {self.policy.timeout_s} s",
                           param=param) from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            cause = exc
            while cause is not None and not isinstance(cause, _PrivateAddress):
                cause = cause.__cause__ or cause.__context__
            if cause is not None:
                raise APIError(f"media URLs on private, loopback or link-local addresses are "
                               f"refused ({cause}); the server allows them with "
                               "--allow-private-media-urls", param=param) from None
            raise APIError(f"cannot fetch the media URL: {type(exc).__name__}: {exc}",
                           param=param) from None

    def _local(self, url: str, param: str) -> bytes:
        root = self.policy.allowed_local_path
        if root is None:
            raise APIError("file:// media URLs are refused: the server allows them only under "
                           "--allowed-local-media-path", param=param)
        parsed = urllib.parse.urlsplit(url)
        if parsed.netloc not in ("", "localhost"):
            raise APIError("a file:// URL must name a local path", param=param)
        path = Path(urllib.parse.unquote(parsed.path)).resolve()
        if not path.is_relative_to(root.resolve()):
            raise APIError("the file is outside --allowed-local-media-path", param=param)
        try:
            if path.stat().st_size > self.policy.max_bytes:
                raise APIError(f"the media item is larger than {self.policy.max_bytes} bytes",
                               param=param)
            return path.read_bytes()
        except OSError:
            raise APIError("cannot read the file", param=param) from None


def decode_image(data: bytes, param: str, max_pixels: int, detail: str | None = None) -> Any:
    """Bytes -> an RGB PIL image (blocking: run it on a preprocessing thread). `detail` "low"
    scales the image to fit 512 x 512 first, as OpenAI's low-detail mode."""
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > max_pixels:
            raise APIError(f"the image has {width} x {height} pixels, more than the server's "
                           f"limit of {max_pixels}", param=param)
        if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
            # a processor scales the short side up to its resolution: a 1 x 10^6 strip would
            # become gigabytes of pixels
            raise APIError(f"the image is {width} x {height} pixels: its sides may differ at "
                           f"most {MAX_ASPECT_RATIO}-fold", param=param)
        image = image.convert("RGB")
    except APIError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise APIError(f"cannot decode the image: {type(exc).__name__}", param=param) from None
    if detail == "low":
        image.thumbnail((512, 512))
    return image


def decode_audio(data: bytes, param: str, sampling_rate: int, max_seconds: float) -> np.ndarray:
    """Bytes -> mono float32 samples at `sampling_rate` (blocking: a preprocessing thread)."""
    try:
        info = soundfile.info(io.BytesIO(data))
        if info.samplerate <= 0 or info.frames <= 0:
            raise APIError("the audio holds no samples", param=param)
        seconds = info.frames / info.samplerate
        if seconds > max_seconds:
            raise APIError(f"the audio lasts {seconds:.1f} s, more than this model's limit of "
                           f"{max_seconds:g} s", param=param)
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except APIError:
        raise
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise APIError(f"cannot decode the audio: {exc}", param=param) from None
    mono = samples.mean(axis=1)
    if rate != sampling_rate:
        mono = soxr.resample(mono, rate, sampling_rate)
    return np.ascontiguousarray(mono, dtype=np.float32)


@dataclass(frozen=True)
class FrameSampling:
    """Qwen2-VL's rule: `fps` frames a second, at least `min_frames` and at most `max_frames`,
    a multiple of `multiple` (the temporal patch)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    multiple: int = 2
    max_seconds: float = 600.0


def decode_video(data: bytes, param: str, sampling: FrameSampling, max_pixels: int) -> list[Any]:
    """Bytes -> the sampled frames as RGB PIL images (blocking: a preprocessing thread)."""
    # PyAV maps FFmpeg's libraries: 21 MB and 0.23 s in every ingress process that imported it
    # at load, though only a video model's requests ever decode one
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise APIError("the file holds no video stream", param=param)
            stream = container.streams.video[0]
            rate = float(stream.average_rate or stream.guessed_rate or 0)
            seconds = (float(stream.duration * stream.time_base) if stream.duration
                       else container.duration / av.time_base if container.duration else 0.0)
            total = stream.frames or round(seconds * rate)
            if rate <= 0 or total <= 0:
                raise APIError("the video's frame rate or length is unknown", param=param)
            if seconds > sampling.max_seconds:
                raise APIError(f"the video lasts {seconds:.0f} s, more than the server's limit "
                               f"of {sampling.max_seconds:g} s", param=param)
            if stream.codec_context.width * stream.codec_context.height > max_pixels:
                raise APIError("the video's frames have more pixels than the server's limit "
                               f"of {max_pixels}", param=param)
            wanted = set(sample_frames(total, rate, sampling))
            frames = [frame.to_image() for i, frame in enumerate(container.decode(stream))
                      if i in wanted]
    except APIError:
        raise
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise APIError(f"cannot decode the video: {type(exc).__name__}: {exc}",
                       param=param) from None
    if not frames:
        raise APIError("the video holds no frames", param=param)
    return frames


def sample_frames(total: int, rate: float, sampling: FrameSampling) -> list[int]:
    """Indices of the frames to keep, as transformers' Qwen2VLVideoProcessor.sample_frames."""
    most = max(sampling.multiple,
               min(sampling.max_frames, total) // sampling.multiple * sampling.multiple)
    wanted = min(max(total / rate * sampling.fps, sampling.min_frames), most)
    count = max(sampling.multiple, int(wanted // sampling.multiple * sampling.multiple))
    return sorted({int(i) for i in np.arange(0, total, total / count)})
