"""The job token the in-process masters of the master tests are built with, and the client side of it."""
import pytest

from recforge.elastic.master.service import JobMaster

TOKEN = "test-token-" + "x" * 32


@pytest.fixture
def token_env(monkeypatch):
    """MasterClient reads the job's token from RECFORGE_MASTER_TOKEN (masters here are built with TOKEN)."""
    monkeypatch.setenv("RECFORGE_MASTER_TOKEN", TOKEN)
    monkeypatch.delenv("RECFORGE_MASTER_TOKEN_FILE", raising=False)


def master_with_token(*args, **kwargs) -> JobMaster:
    return JobMaster(*args, token=TOKEN, **kwargs)
