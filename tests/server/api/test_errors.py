"""Errors in OpenAI's shape, for routes and methods that do not exist too."""

from __future__ import annotations

import httpx2


def test_unknown_route_and_method_are_openai_shaped(live_server):
    r = httpx2.get(live_server.url + "/v1/nope")
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    r = httpx2.get(live_server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
