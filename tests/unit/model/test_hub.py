"""A model reference that is no local folder: one request to the Hub (here a local stand-in server),
never a wait on retries; the cache where the Hub is out of reach; one line otherwise."""

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from bert_mp.errors import ConfigError
from bert_mp.model.hub import resolve_hub_model


@pytest.fixture
def hub(monkeypatch):
    """A stand-in Hub answering HEAD with ``hub.status`` (and ``hub.headers``); ``hub.requests`` counts."""
    from huggingface_hub import constants

    class Handler(BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802 - http.server's naming
            state.requests.append(self.path)
            self.send_response(state.status)
            for k, v in state.headers.items():
                self.send_header(k, v)
            self.send_header("ETag", '"abc"')
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    class State:
        status, headers, requests = 200, {}, []

    state = State()
    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    yield state
    server.shutdown()
    server.server_close()


def test_a_hub_name_the_hub_has_is_kept(hub):
    assert resolve_hub_model("org/model", "finetune.checkpoint") == "org/model"
    assert hub.requests == ["/org/model/resolve/main/config.json"]


def test_a_name_the_hub_does_not_have_is_one_line_after_one_request(hub):
    hub.status, hub.headers = 401, {"X-Error-Code": "RepoNotFound"}
    with pytest.raises(
        ConfigError,
        match=r"^finetune\.checkpoint: runs/nonexistent is neither a local folder nor a model on the Hub",
    ):
        resolve_hub_model("runs/nonexistent", "finetune.checkpoint")
    assert len(hub.requests) == 1


def test_an_unreachable_hub_is_asked_once_then_the_cache_stands_in(hub, monkeypatch, tmp_path):
    import huggingface_hub

    hub.status = 503  # retried five times by from_pretrained; here asked once
    with pytest.raises(
        ConfigError,
        match=r"^model\.init_from: org/model is neither a local folder nor in the Hub cache, and the Hub cannot be reached",
    ):
        resolve_hub_model("org/model", "model.init_from")
    assert len(hub.requests) == 1
    cached = tmp_path / "snapshots" / "abc"
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: str(cached / name))
    assert resolve_hub_model("org/model", "k") == str(cached)


def test_offline_asks_nothing(hub, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        ConfigError, match=r"^k: org/model is neither a local folder nor in the Hub cache \(HF_HUB_OFFLINE=1"
    ):
        resolve_hub_model("org/model", "k")
    assert hub.requests == []


def test_an_invalid_name_and_a_repository_without_the_file(hub):
    with pytest.raises(ConfigError, match="neither a local folder nor a Hub name"):
        resolve_hub_model("bad name!!", "k")
    hub.status, hub.headers = 404, {"X-Error-Code": "EntryNotFound"}
    with pytest.raises(ConfigError, match="on the Hub has no config.json"):
        resolve_hub_model("org/dataset-like", "k")


def test_a_reference_is_asked_about_once_a_process_and_again_where_the_hub_changes(hub, monkeypatch):
    """The CLI checks a reference before the command's libraries load and the command checks it again:
    one request. Another Hub address, or offline, is another question."""
    from huggingface_hub import constants

    assert resolve_hub_model("org/once", "model.init_from") == "org/once"
    assert resolve_hub_model("org/once", "finetune.checkpoint") == "org/once"
    assert hub.requests == ["/org/once/resolve/main/config.json"]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE=1"):
        resolve_hub_model("org/once", "k")
