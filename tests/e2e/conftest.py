"""One set of live services for the whole e2e session (the API test and the browser test share it)."""
import time
from datetime import UTC, datetime, timedelta

import pytest

from e2e_services import TINY, LiveServices, running, services, start
from recforge.pipelines.landing import land_synthetic


@pytest.fixture(scope="session")
def live(tmp_path_factory) -> LiveServices:
    home = tmp_path_factory.mktemp("live") / "home"
    # the default path: runs triggered today (run day = today, UTC) wait for and read today's and tomorrow's
    # files in the services' landing zone (a day either side: a session that crosses midnight)
    today = datetime.now(UTC).date()
    land_synthetic(home / "landing", today - timedelta(days=1), 4, rows_per_day=TINY["rows_per_day"])
    # a retried task (test_train_retry_resumes) starts soon, yet after the scheduler restart that test does meanwhile
    svc = start(home, RECFORGE_RETRY_DELAY_S="12")
    pids = {p.stem: int(p.read_text()) for p in (home / "run").glob("*.pid")}
    try:
        svc.wait_for_dag()
        svc.unpause()
        deadline = time.monotonic() + 20  # the scheduled run the unpause creates appears within seconds
        while time.monotonic() < deadline and not svc.fail_foreign_runs():
            time.sleep(2)
        yield svc
    finally:
        svc.keep_logs("live")
        down = services("down", svc.env)
        assert down.returncode == 0, down.stdout + down.stderr
        assert not list((home / "run").glob("*.pid")), "make down left pid files"
        assert not [n for n, p in pids.items() if running(p)], f"still running after down: {pids}"
