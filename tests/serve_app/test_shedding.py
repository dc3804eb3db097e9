"""The shedding layer answers a full server's generation POSTs itself, before routing and body
parsing, with the 503 envelope; everything else passes through."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from serve_app.admission import Admission
from serve_app.config import AppConfig
from serve_app.errors import install_handlers
from serve_app.shedding import Shedding


def _app(admission: Admission, draining: list[bool]) -> tuple[FastAPI, list[str]]:
    app = FastAPI()
    install_handlers(app)
    app.add_middleware(Shedding)
    app.state.check_room = lambda: admission.check_room(draining[0])
    seen: list[str] = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        seen.append((await request.body()).decode())
        return {"ok": True}

    @app.post("/tokenize")
    async def tokenize() -> dict:
        seen.append("tokenize")
        return {"ok": True}
    return app, seen


def test_a_full_server_sheds_generation_posts_before_the_route() -> None:
    config = AppConfig.model_validate({"models": [{"model": "shardserve/tiny-llama",
                                                   "max_num_seqs": 1, "max_waiting": 1}]})
    admission = Admission(config)
    draining = [False]
    app, seen = _app(admission, draining)
    client = TestClient(app)
    assert client.post("/v1/chat/completions", content=b"{}").json() == {"ok": True}
    model = "shardserve/tiny-llama"
    tickets = [admission.admit(model, None) for _ in range(admission.limits[model])]
    r = client.post("/v1/chat/completions", content=b"not even json")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "overloaded" in r.json()["error"]["message"]
    assert client.post("/tokenize").status_code == 200  # not a generation route
    assert client.get("/v1/chat/completions").status_code == 405  # routing as usual
    assert seen == ["{}", "tokenize"]
    assert admission.rejected[model, "overloaded"] == 1
    for t in tickets:
        t.release()
    draining[0] = True
    r = client.post("/v1/chat/completions", content=b"{}")
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
