"""The job master's control plane: the bearer token on every endpoint, strict bodies, size limits. Every refused
call answers 4xx, is logged (without the token) and leaves the master's state byte for byte as it was."""
from __future__ import annotations

import logging
import os
import stat

import httpx
import pytest

from recforge.elastic.agent.client import (
    MasterAuthError,
    MasterClient,
    read_token_file,
    resolve_token,
    write_token_file,
)
from recforge.elastic.master.service import JobMaster
from recforge.elastic.master.state_log import read_master_state

TOKEN = "job-a-" + "t" * 40
OTHER = "job-b-" + "o" * 40

WORKER_CALLS = {  # endpoint -> a valid body for worker "a" (who holds a task)
    "/lease": {"worker_id": "a", "generation": 0, "request_id": "r9"},
    "/done": {"worker_id": "a", "task_id": "e0-s0-r0", "samples": 4, "generation": 0},
    "/release": {"worker_id": "a", "task_id": "e0-s0-r0", "rows_consumed": 2, "generation": 0},
    "/heartbeat": {"worker_id": "a", "step": 5, "generation": 0},
    "/join": {"worker_id": "a", "generation": 0},
    "/snapshot": {"worker_id": "a", "generation": 0, "progress": {}},
    "/restore": {"worker_id": "a", "generation": 0, "state": None, "reason": "x"},
    "/scale": {"workers": 1, "reason": "x"},
    "/command": {"worker_id": "a", "generation": 0},
    "/recover": {"worker_id": "a"},
}


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def master(tmp_path):
    with JobMaster([8, 8], rows_per_task=4, lease_timeout_s=10.0, clock=FakeClock(), expiry_interval_s=3600,
                   max_workers=4, token=TOKEN, state_file=tmp_path / "state.json") as m:
        with MasterClient(m.url, "a", token=TOKEN) as a:
            a.lease()
        yield m


HTTP = httpx.Client(timeout=30)


def raw_state(m: JobMaster) -> bytes:
    """GET /state with the right token: the bytes the master answers (its whole visible state)."""
    r = HTTP.get(f"{m.url}/state", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200
    return r.content


def persisted(m: JobMaster) -> dict:
    """What the master has written (snapshot + log): a refused call must add nothing."""
    return read_master_state(m.state_file)


@pytest.mark.parametrize("headers, why", [({}, "no Authorization header"),
                                          ({"Authorization": "Bearer wrong"}, "wrong token"),
                                          ({"Authorization": f"Bearer {OTHER}"}, "wrong token"),
                                          ({"Authorization": TOKEN}, "wrong token")])
def test_every_endpoint_refuses_a_missing_or_wrong_token(master, headers, why, caplog):
    before, lines = raw_state(master), persisted(master)
    with caplog.at_level(logging.WARNING, logger="recforge.elastic.master.service"):
        for path, body in WORKER_CALLS.items():
            r = HTTP.post(f"{master.url}{path}", json=body, headers=headers)
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"] == "Unauthorized" and why in r.json()["detail"]
        r = HTTP.get(f"{master.url}/state", headers=headers)
        assert r.status_code == 401
    assert raw_state(master) == before and persisted(master) == lines
    refused = [rec.getMessage() for rec in caplog.records if "refused (401)" in rec.getMessage()]
    assert len(refused) == len(WORKER_CALLS) + 1 and all(why in m for m in refused)
    assert not any(TOKEN in rec.getMessage() or OTHER in rec.getMessage() for rec in caplog.records)


def test_a_token_of_another_job_is_refused_and_not_retried(master, caplog):
    with JobMaster([4], rows_per_task=4, token=OTHER) as other:
        before = raw_state(master)
        with caplog.at_level(logging.WARNING, logger="recforge.elastic.master.service"):
            c = MasterClient(master.url, "a", token=other.token, max_attempts=5, backoff_s=0.01)
            with pytest.raises(MasterAuthError, match="HTTP 401.*wrong or missing token"):
                c.heartbeat(1)
        assert sum("refused (401)" in r.getMessage() for r in caplog.records) == 1  # one try, no retries
        assert raw_state(master) == before
        assert MasterClient(other.url, "x", token=other.token).join()["epoch"] == 0  # its own job accepts it


@pytest.mark.parametrize("path, body, field", [
    ("/heartbeat", {"worker_id": "a", "step": "5", "generation": 0}, "step"),  # a number as a string
    ("/heartbeat", {"worker_id": "a", "step": 1.5, "generation": 0}, "step"),
    ("/done", {"worker_id": 7, "task_id": "e0-s0-r0", "samples": 4}, "worker_id"),
    ("/done", {"worker_id": "a", "task_id": "e0-s0-r0", "samples": -1}, "samples"),
    ("/lease", {"worker_id": "a", "generation": [0]}, "generation"),
    ("/lease", {"worker_id": "a", "generation": 0, "admin": True}, "admin"),  # unknown field
    ("/lease", {"worker_id": "", "generation": 0}, "worker_id"),
    ("/restore", {"worker_id": "a", "state": "all done"}, "state"),
    ("/snapshot", {"worker_id": "a", "progress": {"e0-s0-r0": "2"}}, "progress"),
    ("/scale", {"workers": "9"}, "workers"),
    ("/recover", [], ""),
])
def test_wrong_types_are_422_and_change_nothing(master, path, body, field, caplog):
    before, lines = raw_state(master), persisted(master)
    with caplog.at_level(logging.WARNING, logger="recforge.elastic.master.service"):
        r = HTTP.post(f"{master.url}{path}", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 422, r.text
    assert r.json()["error"] == "ValidationError" and field in str(r.json()["detail"])
    assert any("refused (422)" in rec.getMessage() for rec in caplog.records)
    assert raw_state(master) == before and persisted(master) == lines


def test_not_json_is_422(master):
    before = raw_state(master)
    for data in (b"", b"{not json", b"\xff\xfe"):
        r = HTTP.post(f"{master.url}/heartbeat", content=data, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 422, r.text
    assert raw_state(master) == before


def test_huge_bodies_are_413_before_parsing(master, caplog):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    limit = master.max_body_bytes
    assert limit >= 1 << 20
    before, lines = raw_state(master), persisted(master)
    big = {"worker_id": "a", "step": 1, "generation": 0, "held": ["x" * 1000] * (limit // 1000 + 10)}
    with caplog.at_level(logging.WARNING, logger="recforge.elastic.master.service"):
        r = HTTP.post(f"{master.url}/heartbeat", json=big, headers=auth)
        assert r.status_code == 413 and f"limit of {limit} bytes" in r.json()["detail"]

        def chunks():  # no Content-Length: counted while it streams
            for _ in range(limit // 65536 + 2):
                yield b" " * 65536

        r = HTTP.post(f"{master.url}/restore", content=chunks(), headers=auth)
        assert r.status_code == 413
    assert sum("refused (413)" in rec.getMessage() for rec in caplog.records) == 2
    assert raw_state(master) == before and persisted(master) == lines
    ok = HTTP.post(f"{master.url}/heartbeat", content=b'{"worker_id":"a","step":1}', headers=auth)
    assert ok.status_code == 200  # small bodies, streamed or not, still pass


def test_unknown_workers_stale_generations_and_bad_states_change_nothing(master):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    before, lines = raw_state(master), persisted(master)
    for path in ("/done", "/release", "/heartbeat", "/snapshot", "/command"):
        body = {**WORKER_CALLS[path], "worker_id": "ghost"}
        r = HTTP.post(f"{master.url}{path}", json=body, headers=auth)
        assert r.status_code == 404 and "unknown worker id 'ghost'" in r.json()["detail"], r.text
    bad_state = {"worker_id": "newcomer", "generation": 0, "state": {"version": 1, "shard_rows": [5]}}
    r = HTTP.post(f"{master.url}/restore", json=bad_state, headers=auth)
    assert r.status_code == 400 and "bad data state" in r.json()["detail"]
    r = HTTP.post(f"{master.url}/snapshot", json={"worker_id": "a", "progress": {"e0-s1-r0": 1}}, headers=auth)
    assert r.status_code == 400 and "not in flight" in r.json()["detail"]
    r = HTTP.post(f"{master.url}/scale", json={"workers": 99}, headers=auth)
    assert r.status_code == 422 and "max_workers=4" in r.json()["detail"]
    assert raw_state(master) == before and persisted(master) == lines  # the newcomer was not registered either


def test_client_token_from_argument_env_or_file(tmp_path, monkeypatch):
    monkeypatch.delenv("RECFORGE_MASTER_TOKEN", raising=False)
    monkeypatch.delenv("RECFORGE_MASTER_TOKEN_FILE", raising=False)
    with pytest.raises(ValueError, match="RECFORGE_MASTER_TOKEN or RECFORGE_MASTER_TOKEN_FILE"):
        MasterClient("http://127.0.0.1:1", "a")
    path = tmp_path / "secret" / "token"
    token = write_token_file(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(token) >= 32
    assert read_token_file(path) == token and not list(path.parent.glob(".token.*"))
    monkeypatch.setenv("RECFORGE_MASTER_TOKEN_FILE", str(path))
    assert resolve_token() == token
    monkeypatch.setenv("RECFORGE_MASTER_TOKEN", "from-env")
    assert resolve_token() == "from-env" and resolve_token("given") == "given"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_token_file(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="token file not found"):
        read_token_file(tmp_path / "nope")


def test_master_generates_a_token_and_refuses_short_ones():
    m = JobMaster([4], rows_per_task=4)
    assert len(m.token) >= 32 and m.token != JobMaster([4], rows_per_task=4).token
    with pytest.raises(ValueError, match="at least 16"):
        JobMaster([4], rows_per_task=4, token="short")
