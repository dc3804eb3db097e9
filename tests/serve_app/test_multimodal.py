"""Media in chat messages, through the real app on the embedded tiny LLaVA and tiny Qwen2-Audio
(one app serving both) and the openai SDK: images by data and HTTP URLs, several images and turns,
streaming, n, structured output, the prefix cache keyed by content, /tokenize, audio as
input_audio (wav, mp3) and audio_url, and every bad input a 400 naming its part."""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import av
import httpx
import jsonschema
import numpy as np
import pytest
import soundfile
from openai import BadRequestError, OpenAI
from PIL import Image

from replicas.embedded import (TINY_LLAVA_MODEL_ID, TINY_QWEN2_5_VL_MODEL_ID,
                               TINY_QWEN2_AUDIO_MODEL_ID)
from tests.conftest import shared_app

MODEL, AUDIO_MODEL, VL_MODEL = (TINY_LLAVA_MODEL_ID, TINY_QWEN2_AUDIO_MODEL_ID,
                                TINY_QWEN2_5_VL_MODEL_ID)
SMALL = {"max_model_len": 1024, "kv_cache_gib": 0.05, "max_num_seqs": 16, "num_threads": 1,
         "replica_num_cpus": 0.5}
CONFIG = {"models": [{"model": MODEL, **SMALL}, {"model": AUDIO_MODEL, **SMALL},
                     {"model": VL_MODEL, **SMALL}],
          "allow_private_media_urls": True, "limit_mm_per_prompt": {"image": 2, "audio": 2},
          "enable_mm_embeds": True}

pytestmark = pytest.mark.shared_app("multimodal")


def png(colour: tuple[int, int, int], size: tuple[int, int] = (64, 48)) -> bytes:
    """A horizontal gradient over `colour`: images of one size differ only by colour."""
    image = Image.new("RGB", size)
    image.putdata([tuple(min(255, c + x * 3) for c in colour)
                   for _ in range(size[1]) for x in range(size[0])])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


RED, BLUE = png((200, 0, 0)), png((0, 0, 200))


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def ask(*parts: dict[str, Any], text: str = "What is in the image?") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def tone(hz: float, seconds: float = 1.0, fmt: str = "WAV", rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    out = io.BytesIO()
    soundfile.write(out, (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32), rate,
                    format=fmt)
    return out.getvalue()


A440, A880 = tone(440), tone(880)


def clip(frames: int = 12, fps: int = 6, size: tuple[int, int] = (112, 84)) -> bytes:
    """An MPEG-4 video of a moving gradient."""
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
        x = np.arange(size[0])[None, :, None]
        for i in range(frames):
            rgb = np.broadcast_to((x * 2 + i * 20) % 256, (size[1], size[0], 3)).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


VIDEO = clip()


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        body = {"/red.png": RED, "/blue.png": BLUE, "/a440.wav": A440,
                "/clip.mp4": VIDEO}.get(self.path)
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def images_url() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def base_url() -> str:
    return shared_app(CONFIG)


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120)


def greedy(client: OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(model=kwargs.pop("model", MODEL), messages=messages,
                                          temperature=0, max_tokens=kwargs.pop("max_tokens", 8),
                                          **kwargs)


def tokenize(base_url: str, messages: list[dict[str, Any]], model: str = MODEL,
             placeholder: str = "<image>") -> tuple[int, int]:
    """(prompt tokens, of which placeholders)"""
    root = base_url.removesuffix("/v1")
    r = httpx.post(f"{root}/tokenize", json={"model": model, "messages": messages,
                                             "return_token_strs": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["count"], r.json()["token_strs"].count(placeholder)


def test_an_image_by_data_url_counts_its_placeholder_tokens(client: OpenAI,
                                                            base_url: str) -> None:
    messages = ask(image_part(data_url(RED)))
    r = greedy(client, messages)
    assert r.choices[0].message.content is not None
    # the image's one placeholder becomes 16 tokens, counted as vLLM counts them
    assert tokenize(base_url, messages) == (r.usage.prompt_tokens, 16)


def test_the_image_changes_the_logits(client: OpenAI) -> None:
    def first_logprob(image: bytes) -> float:
        r = greedy(client, ask(image_part(data_url(image))), max_tokens=1, logprobs=True)
        return r.choices[0].logprobs.content[0].logprob
    red, blue, red_again = first_logprob(RED), first_logprob(BLUE), first_logprob(RED)
    assert red == pytest.approx(red_again, abs=1e-5)
    assert red != pytest.approx(blue, abs=1e-5)


def test_an_http_url_gives_what_the_same_data_url_gives(client: OpenAI, images_url: str) -> None:
    by_url = greedy(client, ask(image_part(f"{images_url}/blue.png")), max_tokens=12)
    by_data = greedy(client, ask(image_part(data_url(BLUE))), max_tokens=12)
    assert by_url.choices[0].message.content == by_data.choices[0].message.content
    simple = greedy(client, ask({"image_url": f"{images_url}/blue.png"}), max_tokens=12)
    assert simple.choices[0].message.content == by_data.choices[0].message.content


def test_two_images_and_an_image_in_an_earlier_turn(client: OpenAI, base_url: str) -> None:
    two = ask(image_part(data_url(RED)), image_part(data_url(BLUE)))
    r = greedy(client, two)
    assert tokenize(base_url, two) == (r.usage.prompt_tokens, 32)
    turns = [*ask(image_part(data_url(RED))), {"role": "assistant", "content": "A red one."},
             {"role": "user", "content": "And its colour?"}]
    r = greedy(client, turns)
    assert tokenize(base_url, turns) == (r.usage.prompt_tokens, 16)


def test_streaming_and_n(client: OpenAI) -> None:
    messages = ask(image_part(data_url(RED)))
    whole = greedy(client, messages, max_tokens=10).choices[0].message.content
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                            max_tokens=10, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole
    r = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=6,
                                       seed=1)
    assert len(r.choices) == 2


def test_structured_output_with_an_image(client: OpenAI) -> None:
    schema = {"type": "object", "required": ["colour"], "additionalProperties": False,
              "properties": {"colour": {"type": "string", "maxLength": 12}}}
    r = client.chat.completions.create(
        model=MODEL, messages=ask(image_part(data_url(BLUE)), text="Its colour, as JSON"),
        max_tokens=64, response_format={"type": "json_schema", "json_schema": {
            "name": "c", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_the_prefix_cache_shares_an_image_only_with_itself(client: OpenAI) -> None:
    # the image leads the prompt, so everything cached is the image's (or after it)
    colour = png((10, 120, 30))
    other = png((10, 121, 30))  # the same size, one shade apart
    first = greedy(client, ask(image_part(data_url(colour))), max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = greedy(client, ask(image_part(data_url(colour))), max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    different = greedy(client, ask(image_part(data_url(other))), max_tokens=1)
    assert different.usage.prompt_tokens_details.cached_tokens == 0


def bad(client: OpenAI, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    with pytest.raises(BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       extra_body=extra or None)
    assert info.value.status_code == 400
    return info.value.body


@pytest.mark.parametrize(("part", "param", "words"), [
    (image_part("data:image/png;base64,bm90IGFuIGltYWdl"), "messages[0].content[0].image_url",
     "cannot decode"),
    (image_part("data:image/png;base64,%%%"), "messages[0].content[0].image_url", "base64"),
    (image_part("gopher://example.com/a.png"), "messages[0].content[0].image_url", "data:"),
    (image_part("file:///etc/passwd"), "messages[0].content[0].image_url",
     "--allowed-local-media-path"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
     "messages[0].content[0]", "no audio"),
    ({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
     "messages[0].content[0]", "no video"),
    ({"type": "image_embeds", "image_embeds": "AAAA"}, "messages[0].content[0].image_embeds",
     "torch.save"),
    ({"type": "image_url", "image_url": {"url": data_url(RED), "detail": "max"}},
     "messages[0].content[0].image_url.detail", "detail"),
    ({"type": "image_url", "image_url": {"url": data_url(RED)}, "uuid": "abc"},
     "messages[0].content[0].uuid", "uuid"),
    ({"type": "file", "file": {"file_id": "file-1"}}, "messages[0].content[0].file", "file_data"),
])
def test_bad_media_parts_name_the_part(client: OpenAI, part: dict[str, Any], param: str,
                                       words: str) -> None:
    body = bad(client, ask(part))
    assert body["param"] == param, body
    assert words in body["message"], body


def test_limits_placeholders_and_processor_kwargs(client: OpenAI) -> None:
    three = ask(*[image_part(data_url(RED))] * 3)
    body = bad(client, three)
    assert body["param"] == "messages[0].content[2].image_url"
    assert "--limit-mm-per-prompt" in body["message"]
    body = bad(client, ask(text="a literal <image> in text"))
    assert "placeholder" in body["message"]
    body = bad(client, ask(image_part(data_url(RED))), mm_processor_kwargs={"num_crops": 4})
    assert body["param"] == "mm_processor_kwargs"
    body = bad(client, ask(image_part(data_url(RED))),
               mm_processor_kwargs={"crop_size": {"height": 28, "width": 28}})
    assert body["param"] == "mm_processor_kwargs" and "56" in body["message"]
    # a file part with an image's data URL is that image
    r = greedy(client, ask({"type": "file", "file": {"file_data": data_url(RED)}}))
    assert r.usage.prompt_tokens == greedy(client, ask(image_part(data_url(RED)))
                                           ).usage.prompt_tokens


def audio_part(data: bytes, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def test_audio_by_input_audio_and_url(client: OpenAI, base_url: str, images_url: str) -> None:
    messages = ask(audio_part(A440), text="What is this sound?")
    r = client.chat.completions.create(model=AUDIO_MODEL, messages=messages, temperature=0,
                                       max_tokens=8, logprobs=True)
    # one second at 16 kHz: 100 feature frames -> 25 placeholder tokens (Qwen2-Audio's count)
    assert tokenize(base_url, messages, AUDIO_MODEL, "<|AUDIO|>") == (r.usage.prompt_tokens, 25)
    by_url = client.chat.completions.create(
        model=AUDIO_MODEL, temperature=0, max_tokens=8, logprobs=True,
        messages=ask({"type": "audio_url", "audio_url": {"url": f"{images_url}/a440.wav"}},
                     text="What is this sound?"))
    assert by_url.choices[0].message.content == r.choices[0].message.content
    other = client.chat.completions.create(model=AUDIO_MODEL, temperature=0, max_tokens=1,
                                           logprobs=True,
                                           messages=ask(audio_part(A880), text="What is this sound?"))
    assert (other.choices[0].logprobs.content[0].logprob
            != pytest.approx(r.choices[0].logprobs.content[0].logprob, abs=1e-5))
    mp3 = client.chat.completions.create(model=AUDIO_MODEL, max_tokens=4, messages=ask(
        audio_part(tone(440, 2.0, "MP3"), "mp3")), stream=True)
    assert any(c.choices and c.choices[0].delta.content for c in mp3)
    again = client.chat.completions.create(model=AUDIO_MODEL, messages=messages, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_audio_model_refuses_images_and_long_audio(client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as info:
        client.chat.completions.create(model=AUDIO_MODEL, max_tokens=2,
                                       messages=ask(image_part(data_url(RED))))
    assert info.value.body["param"] == "messages[0].content[0]"
    assert "no image" in info.value.body["message"]
    with pytest.raises(BadRequestError) as info:
        client.chat.completions.create(model=AUDIO_MODEL, max_tokens=2,
                                       messages=ask(audio_part(tone(440, 31, rate=8000))))
    assert info.value.body["param"] == "messages[0].content[0].input_audio"
    assert "30 s" in info.value.body["message"]


def test_dynamic_resolution_and_3d_positions(client: OpenAI, base_url: str,
                                              images_url: str) -> None:
    """Qwen2.5-VL: an image's token count follows its size; M-RoPE positions make the same image
    give the same answer by data and HTTP URL, after text or beside another image."""
    small, big = png((200, 0, 0), (56, 56)), png((0, 0, 200), (112, 84))

    def count(*parts: dict[str, Any]) -> tuple[int, int]:
        return tokenize(base_url, ask(*parts), VL_MODEL, "<|image_pad|>")
    n_small, n_big = count(image_part(data_url(small)))[1], count(image_part(data_url(big)))[1]
    assert 0 < n_small < n_big
    both = ask(image_part(data_url(small)), image_part(data_url(big)))
    r = greedy(client, both, model=VL_MODEL, max_tokens=12)
    assert tokenize(base_url, both, VL_MODEL, "<|image_pad|>") == (r.usage.prompt_tokens,
                                                                   n_small + n_big)
    by_url = greedy(client, ask(image_part(f"{images_url}/blue.png")), model=VL_MODEL,
                    max_tokens=12)
    by_data = greedy(client, ask(image_part(data_url(BLUE))), model=VL_MODEL, max_tokens=12)
    assert by_url.choices[0].message.content == by_data.choices[0].message.content
    assert by_data.usage.prompt_tokens_details.cached_tokens >= 16  # the same image again
    stream = client.chat.completions.create(model=VL_MODEL, messages=both, temperature=0,
                                            max_tokens=12, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream
                   if c.choices) == r.choices[0].message.content


def test_video_by_url_and_data_url(client: OpenAI, base_url: str, images_url: str) -> None:
    """12 frames at 6 fps, sampled at 2 fps: 4 frames, 2 temporal patches of 112 x 84 px."""
    by_url = ask({"type": "video_url", "video_url": {"url": f"{images_url}/clip.mp4"}},
                 text="What happens?")
    r = greedy(client, by_url, model=VL_MODEL, max_tokens=10)
    count = tokenize(base_url, by_url, VL_MODEL, "<|video_pad|>")
    assert count == (r.usage.prompt_tokens, 2 * 6 * 8 // 4)
    data = "data:video/mp4;base64," + base64.b64encode(VIDEO).decode()
    same = greedy(client, ask({"video_url": data}, text="What happens?"), model=VL_MODEL,
                  max_tokens=10)
    assert same.choices[0].message.content == r.choices[0].message.content
    both = ask({"video_url": data}, image_part(data_url(RED)))
    assert greedy(client, both, model=VL_MODEL).usage.prompt_tokens == tokenize(
        base_url, both, VL_MODEL, "<|video_pad|>")[0]
    with pytest.raises(BadRequestError) as info:
        greedy(client, ask({"video_url": "data:video/mp4;base64,AAAA"}), model=VL_MODEL)
    assert info.value.body["param"] == "messages[0].content[0].video_url"
    assert "cannot decode the video" in info.value.body["message"]


def test_image_embeds_stand_in_for_the_image(client: OpenAI) -> None:
    """The tower's own rows for an image, sent as image_embeds (--enable-mm-embeds), give the
    answer the image gives; rows of the wrong width are a 400."""
    import torch
    import transformers

    from replicas.embedded import EMBEDDED_MODELS

    folder = EMBEDDED_MODELS[MODEL]()
    processor = transformers.AutoProcessor.from_pretrained(folder)
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    pixels = processor.image_processor([Image.open(io.BytesIO(BLUE))],
                                       return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        rows = hf.model.get_image_features(pixel_values=pixels).pooler_output[0]

    def b64(tensor: torch.Tensor) -> str:
        out = io.BytesIO()
        torch.save(tensor, out)
        return base64.b64encode(out.getvalue()).decode()
    by_image = greedy(client, ask(image_part(data_url(BLUE))), max_tokens=12)
    by_rows = greedy(client, ask({"type": "image_embeds", "image_embeds": b64(rows)}),
                     max_tokens=12)
    assert by_rows.choices[0].message.content == by_image.choices[0].message.content
    assert by_rows.usage.prompt_tokens == by_image.usage.prompt_tokens
    body = bad(client, ask({"type": "image_embeds", "image_embeds": b64(rows[:, :8])}))
    assert body["param"] == "messages[0].content[0].image_embeds"
    assert "hidden size" in body["message"]


def test_metrics_count_encoder_work_and_cache_hits(client: OpenAI, base_url: str) -> None:
    root = base_url.removesuffix("/v1")

    def counters() -> tuple[float, float]:
        text = httpx.get(f"{root}/metrics", timeout=10).text
        found = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                 if line.startswith(("shardserve:encoder_items_total{",
                                     "shardserve:encoder_cache_hits_total{"))
                 and f'model_name="{MODEL}"' in line}
        return (found.get(f'shardserve:encoder_items_total{{model_name="{MODEL}"}}', 0.0),
                found.get(f'shardserve:encoder_cache_hits_total{{model_name="{MODEL}"}}', 0.0))

    def settled(before: tuple[float, float], items: float, hits: float) -> tuple[float, float]:
        deadline = time.monotonic() + 15  # /metrics follows the replicas' reports
        while (now := counters()) != (before[0] + items, before[1] + hits):
            assert time.monotonic() < deadline, (before, now, items, hits)
            time.sleep(0.25)
        return now

    before = counters()
    fresh = ask(image_part(data_url(png((1, 2, 3)))))
    greedy(client, fresh, max_tokens=1)
    after = settled(before, 1, 0)
    greedy(client, fresh, max_tokens=1)  # the whole prompt but its last token is cached KV
    greedy(client, ask(image_part(data_url(png((1, 2, 3)))), text="Other words"), max_tokens=1)
    settled(after, 0, 1)


def test_the_server_keeps_serving(client: OpenAI) -> None:
    r = greedy(client, [{"role": "user", "content": "Hello"}])
    assert r.choices[0].finish_reason in ("stop", "length")
