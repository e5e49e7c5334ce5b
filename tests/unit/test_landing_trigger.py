"""The landing sensor's trigger, run with asyncio directly against real local files and fsspec's memory:// file
system: a file that appears fires it, one that never does times out naming the path and the day, a file still
changing is not taken; plus the one-look rules (settling, ready marker, hidden files) and the templates."""
import asyncio
import os
import time
import uuid
from datetime import date

import fsspec
import pytest

from recforge.config import PipelineConfig
from recforge.pipelines import landing
from recforge.pipelines.landing_trigger import LandingTrigger, list_day, look

DAY = "2026-03-04"


def _want(pattern: str, marker: str | None = None, day: str = DAY, role: str = "train") -> dict:
    return {"day": day, "role": role, "pattern": pattern, "marker": marker}


def _trigger(expected: list[dict], timeout_s: float, poke_s: float = 0.05, previous=None) -> LandingTrigger:
    return LandingTrigger(run_day=DAY, expected=expected, poke_s=poke_s, deadline=time.time() + timeout_s,
                          timeout_s=timeout_s, previous=previous)


async def _first_event(trigger: LandingTrigger, bound_s: float = 30.0):
    return await asyncio.wait_for(anext(trigger.run()), bound_s)  # a bound against hangs, not a timing check


def _memory_root() -> str:
    return f"memory://landing-{uuid.uuid4().hex[:8]}"


def test_a_local_file_that_appears_later_fires_the_trigger(tmp_path):
    path = tmp_path / f"day_{DAY}.tsv.gz"

    async def scenario():
        task = asyncio.create_task(_first_event(_trigger([_want(str(path))], timeout_s=60)))
        await asyncio.sleep(0.2)
        assert not task.done()  # nothing there yet: still waiting
        tmp = tmp_path / ".part"
        tmp.write_bytes(b"1\t2\n")
        os.replace(tmp, path)
        return await task

    event = asyncio.run(scenario())
    assert event.payload["status"] == "ready"
    assert event.payload["files"] == {DAY: [str(path)]}


def test_a_memory_file_that_appears_later_fires_the_trigger():
    root = _memory_root()
    fs = fsspec.filesystem("memory")

    async def scenario():
        task = asyncio.create_task(_first_event(_trigger([_want(f"{root}/dt={DAY}/part-*.tsv")], timeout_s=60)))
        await asyncio.sleep(0.2)
        assert not task.done()
        fs.pipe(f"{root}/dt={DAY}/part-0.tsv", b"1\t2\n")
        return await task

    event = asyncio.run(scenario())
    assert event.payload["status"] == "ready"
    assert [u.rsplit("/", 1)[-1] for u in event.payload["files"][DAY]] == ["part-0.tsv"]
    assert event.payload["files"][DAY][0].startswith("memory://")


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_file_that_never_lands_times_out_naming_the_path_and_the_day(tmp_path, where):
    missing = str(tmp_path / "day_2026-03-05.tsv.gz") if where == "local" else f"{_memory_root()}/day_2026-03-05.tsv"
    present = tmp_path / f"day_{DAY}.tsv.gz"
    present.write_bytes(b"x")
    os.utime(present, (0, 0))  # written long ago: landed
    trigger = _trigger([_want(str(present)), _want(missing, day="2026-03-05", role="holdout")], timeout_s=0.3)
    event = asyncio.run(_first_event(trigger))
    assert event.payload["status"] == "timeout"
    message = event.payload["message"]
    assert f"run day {DAY}" in message and "2026-03-05 (holdout day)" in message and missing in message
    assert str(present) not in message  # only what is missing is named
    assert event.payload["missing"] == [f"2026-03-05 (holdout day): no file matches {missing}"]


def test_a_file_still_being_written_is_not_taken(tmp_path):
    path = tmp_path / f"day_{DAY}.tsv"
    path.write_bytes(b"a" * 10)
    want = [_want(str(path))]
    now = path.stat().st_mtime + 1.0
    # just written (modified 1 s ago, settle 60 s) and nothing seen before: not yet
    [day] = look(want, {}, settle_s=60, now=now)
    assert not day.ready and "changed within the last 60 s" in day.why
    # seen at an earlier look with another size: still growing
    [day] = look(want, {DAY: {str(path): 5}}, settle_s=60, now=now)
    assert not day.ready
    # the same size at two looks a poke apart: landed; or not modified for the settle time
    assert look(want, {DAY: {str(path): 10}}, settle_s=60, now=now)[0].ready
    assert look(want, {}, settle_s=60, now=now + 60)[0].ready


def test_a_memory_file_still_growing_is_not_taken():
    fs = fsspec.filesystem("memory")
    url = f"{_memory_root()}/day_{DAY}.tsv"
    fs.pipe(url, b"a" * 5)
    [first] = look([_want(url)], {}, settle_s=3600)
    assert not first.ready  # created just now
    fs.pipe(url, b"a" * 9)  # the producer wrote more
    [second] = look([_want(url)], {DAY: first.sizes}, settle_s=3600)
    assert not second.ready and second.sizes == {url: 9}
    assert look([_want(url)], {DAY: second.sizes}, settle_s=3600)[0].ready  # unchanged since


def test_the_trigger_compares_with_what_the_sensor_saw_a_poke_before(tmp_path):
    """`previous` from the sensor: the trigger's first look waits a poke, then the unchanged file counts."""
    path = tmp_path / f"day_{DAY}.tsv"
    path.write_bytes(b"abc")
    trigger = _trigger([_want(str(path))], timeout_s=60, poke_s=0.05, previous={DAY: {str(path): 3}})
    event = asyncio.run(_first_event(trigger))
    assert event.payload["status"] == "ready"


def test_an_empty_file_and_a_missing_marker_are_waited_for(tmp_path):
    path = tmp_path / f"day_{DAY}.tsv"
    path.write_bytes(b"")
    [day] = look([_want(str(path))], {DAY: {str(path): 0}}, settle_s=0)
    assert not day.ready and "is empty" in day.why
    path.write_bytes(b"rows")
    marker = str(tmp_path / "_SUCCESS")
    [day] = look([_want(str(path), marker=marker)], {}, settle_s=3600)
    assert not day.ready and f"not the ready marker {marker}" in day.why
    (tmp_path / "_SUCCESS").write_bytes(b"")
    assert look([_want(str(path), marker=marker)], {}, settle_s=3600)[0].ready  # the marker says so: no settling


def test_a_glob_skips_hidden_and_marker_files(tmp_path):
    for name in ("part-1.tsv", "part-0.tsv", "_SUCCESS", ".part-2.tsv.inprogress"):
        (tmp_path / name).write_bytes(b"x")
    assert [p.rsplit("/", 1)[-1] for p in list_day(str(tmp_path / "*"))] == ["part-0.tsv", "part-1.tsv"]


def test_an_unreadable_landing_zone_is_an_error_event():
    event = asyncio.run(_first_event(_trigger([_want(f"nosuchfs://bucket/day_{DAY}.tsv")], timeout_s=60)))
    assert event.payload["status"] == "error"
    assert f"run day {DAY}" in event.payload["message"] and "nosuchfs" in event.payload["message"]


def test_the_trigger_serializes_to_itself():
    trigger = _trigger([_want("/x/day_2026-03-04.tsv")], timeout_s=10, previous={DAY: {"/x/a": 1}})
    path, kwargs = trigger.serialize()
    assert path == "recforge.pipelines.landing_trigger.LandingTrigger"
    assert LandingTrigger(**kwargs).serialize() == (path, kwargs)


def test_the_window_and_the_templates():
    cfg = PipelineConfig(source_uri="s3://b/clicks/dt={ds}/part-*.parquet", ready_marker="s3://b/{ds_nodash}/_OK",
                         train_days=2)
    run = date(2026, 3, 4)
    assert [(w["day"], w["role"]) for w in landing.expected(cfg, run)] == [
        ("2026-03-03", "train"), ("2026-03-04", "train"), ("2026-03-05", "holdout")]
    assert landing.expected(cfg, run)[0]["pattern"] == "s3://b/clicks/dt=2026-03-03/part-*.parquet"
    assert landing.expected(cfg, run)[2]["marker"] == "s3://b/20260305/_OK"
    split = cfg.model_copy(update={"holdout": "split"})
    assert [d.isoformat() for d, _ in landing.window(split, run)] == ["2026-03-03", "2026-03-04"]
    assert landing.run_day(landing.first_day(run, cfg), cfg) == run
    assert landing.expected(PipelineConfig(), run) == []  # synthetic: nothing to wait for


@pytest.mark.parametrize("uri,problem", [
    ("/data/day.tsv", "names no day"),
    ("/data/day_{date}.tsv", "unknown placeholder {date}"),
    ("/data/day_{ds!r}.tsv", "unknown placeholder {ds!r}"),
    ("/data/day_{ds.tsv", "not a valid path template"),
])
def test_a_bad_template_is_named(uri, problem):
    from pydantic import ValidationError

    for field in ("source_uri", "ready_marker"):
        with pytest.raises(ValidationError, match=problem) as e:
            PipelineConfig(**{field: uri})
        assert e.value.errors()[0]["loc"] == (field,)
    assert PipelineConfig(source_uri="  ").source_uri is None  # empty: synthetic
