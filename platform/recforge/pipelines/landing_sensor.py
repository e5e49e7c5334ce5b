"""`wait_for_data`, the first task of recforge_daily: waits until every landing file the run needs has landed
(landing.expected: the training days ending with the run's day, and the next day with holdout next_day), deferred
to the triggerer (LandingTrigger) so no worker slot is held while waiting. With source_uri empty (synthetic days)
it succeeds at once. Timing out fails the task without a retry, naming the run's day and each missing path."""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseSensorOperator
from airflow.sdk.exceptions import AirflowFailException, AirflowSensorTimeout

from recforge.config import PipelineConfig
from recforge.pipelines import landing
from recforge.pipelines.dag_tasks import config_from_params, record_failure, run_day_of
from recforge.pipelines.landing_trigger import LandingTrigger, look, not_ready_message
from recforge.pipelines.stage import InvalidInput, log_data_error

TASK_ID = "wait_for_data"
# the trigger's own deadline reports what is missing; Airflow's deferral timeout, this much later, is the backstop
DEFERRAL_MARGIN_S = 300.0


class LandingSensor(BaseSensorOperator):
    """Waits for the run's landing files (the run's Params: source_uri, ready_marker, holdout, sensor_timeout_s,
    sensor_poke_s). deferrable=False pokes in the worker instead (no triggerer needed)."""

    ui_color = "#e8f1fb"

    def __init__(self, *, deferrable: bool = True, **kwargs: Any):
        defaults = PipelineConfig()
        kwargs.setdefault("timeout", defaults.sensor_timeout_s)
        kwargs.setdefault("poke_interval", defaults.sensor_poke_s)
        super().__init__(**kwargs)
        self.deferrable = deferrable

    def _plan(self, context: Any) -> tuple[PipelineConfig, str, list[dict[str, Any]]]:
        try:
            config = PipelineConfig.model_validate(config_from_params(dict(context["params"])))
        except InvalidInput as e:
            self._fail(context, e)
            raise AirflowFailException(f"{TASK_ID}: invalid input, not retried: {type(e).__name__}: {e}") from e
        day = run_day_of(context)
        if config.source_uri is not None and day is None:
            raise AirflowFailException(f"{TASK_ID}: the DAG run has no logical date or run_after: no day to wait for")
        return config, day.isoformat() if day else "", landing.expected(config, day) if day else []

    def _fail(self, context: Any, e: BaseException) -> None:
        """The DAG run's MLflow pipeline run FAILED with the reason (no stage has run yet to record it)."""
        record_failure(context["dag_run"].run_id, TASK_ID, e)

    def poke(self, context: Any) -> bool:
        config, _, expected = self._plan(context)
        return all(d.ready for d in look(expected, {}, config.sensor_poke_s))

    def execute(self, context: Any) -> dict[str, Any]:
        config, day, expected = self._plan(context)
        if config.source_uri is None:
            self.log.info("%s: source_uri is empty: synthetic days, nothing to wait for", TASK_ID)
            return {"source": "synthetic"}
        for want in expected:
            self.log.info("%s: run day %s needs %s (%s day)%s", TASK_ID, day, want["pattern"], want["role"],
                          f", ready marker {want['marker']}" if want["marker"] else "")
        looks = look(expected, {}, config.sensor_poke_s)
        if all(d.ready for d in looks):
            return self._landed(day, {d.day: sorted(d.sizes) for d in looks})
        deadline = time.time() + config.sensor_timeout_s
        previous = {d.day: d.sizes for d in looks}
        if self.deferrable:
            self.defer(trigger=LandingTrigger(run_day=day, expected=expected, poke_s=config.sensor_poke_s,
                                              deadline=deadline, timeout_s=config.sensor_timeout_s,
                                              previous=previous),
                       method_name="execute_complete",
                       timeout=timedelta(seconds=config.sensor_timeout_s + DEFERRAL_MARGIN_S))
        while True:  # not deferrable: the same looks, in this worker
            time.sleep(max(0.0, min(config.sensor_poke_s, deadline - time.time())))
            looks = look(expected, previous, config.sensor_poke_s)
            if all(d.ready for d in looks):
                return self._landed(day, {d.day: sorted(d.sizes) for d in looks})
            if time.time() >= deadline:
                self._timeout(context, not_ready_message(day, looks, config.sensor_timeout_s))
            previous = {d.day: d.sizes for d in looks}

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> dict[str, Any]:
        """Back from the triggerer with its event: ready, timeout (fails naming what is missing) or error."""
        event = event or {}
        if event.get("status") == "ready":
            return self._landed(event["run_day"], event["files"])
        message = event.get("message") or f"{TASK_ID}: the trigger ended without an event: {event!r}"
        if event.get("status") == "timeout":
            self._timeout(context, message)
        self._fail(context, InvalidInput(message))
        raise AirflowFailException(message)

    def _timeout(self, context: Any, message: str) -> None:
        """A data error (the data did not come, no retry can fix it): `DATA ERROR: <message>` first in the log,
        recorded so in MLflow, and the task fails with AirflowSensorTimeout (Airflow does not retry it)."""
        from recforge.data.errors import DataError  # lazy: the recforge.data package pulls pyarrow onto the DAG parse

        error = DataError(message, reason="landing data did not arrive")
        log_data_error(error)
        self._fail(context, error)
        raise AirflowSensorTimeout(message)

    def _landed(self, day: str, files: dict[str, list[str]]) -> dict[str, Any]:
        for d, urls in files.items():
            self.log.info("%s: day %s landed: %s", TASK_ID, d, ", ".join(urls))
        return {"source": "landing", "run_day": day, "files": sum(len(u) for u in files.values())}


def wait_for_data(**kwargs: Any) -> LandingSensor:
    """The DAG's first task (dags/recforge_daily.py)."""
    return LandingSensor(task_id=TASK_ID, **kwargs)
