import httpx2
import openai
import pytest

from tests.conftest import LiveServer


@pytest.fixture(scope="module")
def keyed_server(model_dir):
    server = LiveServer(model_dir, api_keys=["client-key-123"], admin_keys=["admin-key-456"])
    yield server
    server.stop()


def test_keys_are_required_except_for_health(keyed_server):
    url = keyed_server.url
    assert httpx2.get(url + "/healthz").status_code == 200
    r = httpx2.get(url + "/v1/status")
    assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"]
    r = httpx2.get(url + "/v1/status", headers={"authorization": "Bearer wrong-key-000"})
    assert r.status_code == 401 and "not valid" in r.json()["error"]["message"]
    assert httpx2.get(url + "/v1/status", headers={"authorization": "Bearer client-key-123"}).status_code == 200
    with openai.OpenAI(base_url=url + "/v1", api_key="admin-key-456") as sdk:
        assert sdk.models.list().data[0].id == "agentjet-tiny"
    with (
        openai.OpenAI(base_url=url + "/v1", api_key="nope-nope-nope") as sdk,
        pytest.raises(openai.AuthenticationError),
    ):
        sdk.models.list()
