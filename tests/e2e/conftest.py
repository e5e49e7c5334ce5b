"""One set of live services for the whole e2e session (the API test and the browser test share it)."""
import os
import time
from datetime import UTC, datetime, timedelta

import pytest

from e2e_services import TINY, LiveServices, artifacts_dir, running, services, start
from recforge.pipelines.landing import land_synthetic


@pytest.fixture(scope="session")
def live(tmp_path_factory) -> LiveServices:
    home = tmp_path_factory.mktemp("live") / "home"
    # the default path: runs triggered today (run day = today, UTC) wait for and read today's and tomorrow's
    # files in the services' landing zone (a day either side: a session that crosses midnight)
    today = datetime.now(UTC).date()
    land_synthetic(home / "landing", today - timedelta(days=1), 4, rows_per_day=TINY["rows_per_day"])
    # landed an hour ago: wait_for_data counts a file as landed once it has not changed for sensor_poke_s (60 s by
    # default, which the browser run keeps); a run triggered sooner than that after this landing waited a whole poke
    # (seen: 64 s of the browser run's wait_for_data when the services came up quickly)
    landed = time.time() - 3600
    for f in (home / "landing").rglob("*"):
        if f.is_file():
            os.utime(f, (landed, landed))
    # a retried task (test_train_retry_resumes) starts soon, yet only after that test has killed the scheduler that
    # recorded the failure (it does so within a second of seeing up_for_retry); the restarted scheduler runs the retry
    svc = start(home, RECFORGE_RETRY_DELAY_S="6")
    pids = {p.stem: int(p.read_text()) for p in (home / "run").glob("*.pid")}
    try:
        svc.wait_for_dag()
        svc.unpause()
        deadline = time.monotonic() + 20  # the scheduled run the unpause creates appears within seconds
        while time.monotonic() < deadline and not svc.fail_foreign_runs():
            time.sleep(1)
        yield svc
    finally:
        svc.keep_logs("live")
        down = services("down", svc.env)
        # what down stopped and how long it took (the session's teardown), next to the services' logs
        (artifacts_dir() / "live" / "down.log").write_text(down.stdout + down.stderr)
        assert down.returncode == 0, down.stdout + down.stderr
        assert not list((home / "run").glob("*.pid")), "make down left pid files"
        assert not [n for n, p in pids.items() if running(p)], f"still running after down: {pids}"
