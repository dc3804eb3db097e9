"""Media URLs under the fetch policy (serve_app/media.py), against a local HTTP server: data URLs,
private addresses refused by default, size and redirect limits, allowed domains, file:// only
under the allowed folder; images decoded with their pixel count checked first; audio mixed to
mono at the model's rate, its duration checked first."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile
from PIL import Image

from serve_app.errors import APIError
from serve_app.media import MediaFetcher, MediaPolicy, decode_audio, decode_image


def png(width: int = 8, height: int = 8, colour: tuple[int, int, int] = (200, 10, 10)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/a.png":
            body = png()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/big":
            self.send_response(200)
            self.end_headers()  # no Content-Length: the limit must hold while reading
            self.wfile.write(b"x" * 300_000)
        elif self.path.startswith("/redirect"):
            hops = int(self.path.removeprefix("/redirect") or 1)
            self.send_response(302)
            self.send_header("Location", "/a.png" if hops <= 1 else f"/redirect{hops - 1}")
            self.end_headers()
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def load(policy: MediaPolicy, url: str) -> bytes:
    async def go() -> bytes:
        fetcher = MediaFetcher(policy)
        try:
            return await fetcher.load(url, "messages[0].content[1].image_url")
        finally:
            await fetcher.close()
    return asyncio.run(go())


def refused(policy: MediaPolicy, url: str) -> APIError:
    with pytest.raises(APIError) as info:
        load(policy, url)
    assert info.value.status == 400
    assert info.value.param == "messages[0].content[1].image_url"
    return info.value


def test_data_urls() -> None:
    data = png()
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    assert load(MediaPolicy(), url) == data
    assert "base64" in refused(MediaPolicy(), "data:image/png;base64,%%%").message
    assert "base64" in refused(MediaPolicy(), "data:image/png,rawbytes").message
    assert "larger" in refused(MediaPolicy(max_bytes=1024),
                               "data:image/png;base64," + "A" * 4000).message
    assert "data:" in refused(MediaPolicy(), "ftp://example.com/a.png").message


def test_private_addresses_are_refused_unless_allowed(server: str) -> None:
    err = refused(MediaPolicy(), f"{server}/a.png")
    assert "--allow-private-media-urls" in err.message
    for host in ("localhost", "[::1]", "169.254.169.254", "10.0.0.1"):
        assert "private" in refused(MediaPolicy(timeout_s=2), f"http://{host}:9/x").message
    assert load(MediaPolicy(allow_private=True), f"{server}/a.png") == png()


def test_fetch_limits(server: str) -> None:
    open_policy = MediaPolicy(allow_private=True, max_bytes=100_000)
    assert "larger than 100000" in refused(open_policy, f"{server}/big").message
    assert "HTTP 404" in refused(open_policy, f"{server}/missing").message
    assert load(open_policy, f"{server}/redirect2") == png()
    assert "redirected more than" in refused(open_policy, f"{server}/redirect9").message
    only = MediaPolicy(allow_private=True, allowed_domains=("example.com",))
    assert "--allowed-media-domains" in refused(only, f"{server}/a.png").message


def test_local_files_only_under_the_allowed_folder(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.png").write_bytes(png())
    (tmp_path / "secret.png").write_bytes(png())
    assert "--allowed-local-media-path" in refused(
        MediaPolicy(), f"file://{tmp_path}/in/a.png").message
    policy = MediaPolicy(allowed_local_path=tmp_path / "in")
    assert load(policy, f"file://{tmp_path}/in/a.png") == png()
    assert "outside" in refused(policy, f"file://{tmp_path}/in/../secret.png").message


def test_decode_checks_pixels_before_decoding() -> None:
    image = decode_image(png(20, 10), "p", max_pixels=1000)
    assert image.size == (20, 10) and image.mode == "RGB"
    with pytest.raises(APIError, match="more than the server's limit"):
        decode_image(png(100, 100), "p", max_pixels=1000)
    with pytest.raises(APIError, match="200-fold"):
        decode_image(png(1000, 4), "p", max_pixels=1 << 24)
    with pytest.raises(APIError, match="cannot decode") as info:
        decode_image(b"not an image", "p", max_pixels=1000)
    assert info.value.param == "p"
    assert decode_image(png(2048, 1024), "p", 1 << 24, detail="low").size == (512, 256)


def audio_bytes(seconds: float, rate: int, fmt: str = "WAV", channels: int = 1) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    wave = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    out = io.BytesIO()
    soundfile.write(out, np.stack([wave] * channels, axis=1), rate, format=fmt)
    return out.getvalue()


def test_audio_is_mono_at_the_models_rate() -> None:
    samples = decode_audio(audio_bytes(0.5, 8000, channels=2), "p", 16000, 30)
    assert samples.dtype == np.float32 and samples.shape == (8000,)
    # a 440 Hz tone stays one: the resampled signal's spectrum peaks there
    peak = np.argmax(np.abs(np.fft.rfft(samples))) * 16000 / len(samples)
    assert abs(peak - 440) < 5
    mp3 = decode_audio(audio_bytes(1.0, 16000, "MP3"), "p", 16000, 30)
    assert abs(len(mp3) - 16000) < 2000  # MP3 frames pad the ends


def test_bad_or_long_audio_is_refused() -> None:
    with pytest.raises(APIError, match="more than this model's limit of 30 s") as info:
        decode_audio(audio_bytes(31, 8000), "messages[0].content[0].input_audio", 16000, 30)
    assert info.value.param == "messages[0].content[0].input_audio"
    with pytest.raises(APIError, match="cannot decode the audio"):
        decode_audio(b"RIFF not really a wave file", "p", 16000, 30)
