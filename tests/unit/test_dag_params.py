"""The daily DAG's Params <-> PipelineConfig: read off the config's fields, validated with errors that name the Param,
and the README's options table generated from them."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from recforge.config import PipelineConfig
from recforge.pipelines.dag_tasks import PARAM_FIELDS, ParamError, config_from_params, default_params, params_markdown

README = Path(__file__).resolve().parents[2] / "README.md"

# every user-facing switch of the pipeline is in the trigger form
SWITCHES = {
    "dataset_schema", "rows_per_day", "train_days", "workers", "threads_per_worker", "epochs", "batch_size", "seed",
    "table_cap", "model_arch", "source_uri", "preprocessing", "corun_mapping", "preprocess_executor",
    "preprocess_plan", "resources_policy", "max_restarts", "checkpoint_every_steps", "checkpoint_flash", "warm_start",
    "champion_margin", "champion_min_auc", "champion_min_rows", "job_timeout_s",
    "ready_marker", "holdout", "holdout_fraction", "sensor_timeout_s", "sensor_poke_s", "prefetch_steps",
    "sparse_dist_pipeline", "prefetch_sched", "fused_interaction", "worker_allocator", "embedding_optimizer",
    "embedding_lr", "dense_optimizer", "dense_lr",
}


def _field(path):
    model = PipelineConfig
    for key in path[:-1]:
        model = model.model_fields[key].annotation
    return model.model_fields[path[-1]]


def test_every_param_maps_to_a_config_field_and_defaults_round_trip():
    params = {name: spec["default"] for name, spec in default_params().items()}
    assert set(params) == set(PARAM_FIELDS) >= SWITCHES
    cfg = PipelineConfig.model_validate(config_from_params(params))
    assert cfg == PipelineConfig()  # the DAG's defaults are the config's defaults


def test_params_are_read_off_the_fields():
    specs = default_params()
    for name, path in PARAM_FIELDS.items():
        assert specs[name]["description"] == _field(path).description != "", f"{name} has no description"
    assert specs["preprocessing"]["enum"] == list(get_args(_field(("preprocessing",)).annotation)) \
        == ["auto", "inline", "corun", "offline"]
    assert specs["preprocess_executor"]["enum"] == ["eager", "fused", "dali"]
    assert specs["resources_policy"] == {**specs["resources_policy"], "type": "string", "default": "dlrover",
                                         "enum": ["static", "dlrover"]}
    assert specs["warm_start"]["enum"] == ["auto", "champion", "scratch"]
    assert "enum" not in specs["dataset_schema"] and specs["dataset_schema"]["examples"] == [
        "criteo_kaggle", "criteo_terabyte"]  # a schema file path is valid too
    assert (specs["workers"]["type"], specs["workers"]["minimum"]) == ("integer", 1)
    assert (specs["max_restarts"]["minimum"], specs["checkpoint_every_steps"]["minimum"]) == (0, 0)
    assert specs["champion_min_auc"] == {**specs["champion_min_auc"], "type": "number", "minimum": 0.0,
                                         "maximum": 1.0}
    assert specs["checkpoint_flash"]["type"] == specs["corun_mapping"]["type"] == "boolean"
    assert specs["source_uri"]["type"] == ["null", "string"]  # optional in the trigger form
    assert specs["holdout"]["enum"] == ["next_day", "split"]
    assert "maximum" not in specs["workers"]  # no bound the config does not have


def test_airflow_params_refuse_what_the_config_refuses():
    """The trigger form validates with the same schema: Airflow's Param accepts each default and rejects a value
    out of range or of the wrong type."""
    from airflow.sdk import Param
    from airflow.sdk.exceptions import ParamValidationError

    for spec in default_params().values():
        Param(**spec).resolve()  # the default validates
    workers = default_params()["workers"]
    for bad in (0, "two", 1.5):
        with pytest.raises(ParamValidationError):
            Param(**workers).resolve(value=bad)
    with pytest.raises(ParamValidationError):
        Param(**default_params()["preprocessing"]).resolve(value="co-run")


def test_params_nest_into_the_config():
    cfg = PipelineConfig.model_validate(config_from_params(
        {"workers": 3, "batch_size": 32, "model_arch": "dlrm_dcn", "preprocessing": "corun", "source_uri": "",
         "corun_mapping": False, "resources_policy": "static", "max_restarts": 0, "checkpoint_every_steps": 0,
         "checkpoint_flash": False, "warm_start": "scratch", "preprocess_executor": "eager",
         "preprocess_plan": "plan1", "threads_per_worker": 2, "champion_min_rows": 10, "champion_margin": 0,
         "prefetch_steps": 0}))
    assert (cfg.resources.workers, cfg.train.batch_size, cfg.model.arch, cfg.preprocessing) \
        == (3, 32, "dlrm_dcn", "corun")
    assert cfg.corun.mapping is False  # a boolean False is a setting, not "not set"
    assert cfg.source_uri is None  # an empty form field means "not set": synthetic days
    assert (cfg.resources.policy, cfg.resources.max_restarts, cfg.resources.threads_per_worker) == ("static", 0, 2)
    assert (cfg.checkpoint.every_steps, cfg.checkpoint.flash, cfg.train.warm_start) == (0, False, "scratch")
    assert (cfg.preprocess_executor, cfg.preprocess_plan, cfg.champion_min_rows, cfg.champion_margin) \
        == ("eager", "plan1", 10, 0.0)
    assert cfg.train.prefetch_steps == 0  # 0 is a setting (the synchronous loop), not "not set"


def test_an_unknown_conf_key_is_named():
    with pytest.raises(ParamError, match=r"unknown recforge_daily param\(s\) \['row_per_day'\]"):
        config_from_params({"row_per_day": 1000, "workers": 2})


@pytest.mark.parametrize(("conf", "message"), [
    ({"workers": 0}, "param 'workers': must be >= 1, got 0"),
    ({"max_restarts": -1}, "param 'max_restarts': must be >= 0, got -1"),
    ({"champion_min_auc": 1.5}, "param 'champion_min_auc': must be <= 1.0, got 1.5"),
    ({"rows_per_day": 99}, "param 'rows_per_day': must be >= 100, got 99"),
    ({"prefetch_steps": -1}, "param 'prefetch_steps': must be >= 0, got -1"),
    ({"prefetch_steps": "off"}, "param 'prefetch_steps': must be an integer, got 'off' (str)"),
    ({"workers": "two"}, "param 'workers': must be an integer, got 'two' (str)"),
    ({"workers": "2"}, "param 'workers': must be an integer, got '2' (str)"),  # the form's type, not pydantic's lax one
    ({"epochs": True}, "param 'epochs': must be an integer, got True (bool)"),
    ({"seed": 1.5}, "param 'seed': must be an integer, got 1.5 (float)"),
    ({"checkpoint_flash": "yes"}, "param 'checkpoint_flash': must be a boolean, got 'yes' (str)"),
    ({"champion_margin": "0.01"}, "param 'champion_margin': must be a number, got '0.01' (str)"),
    ({"source_uri": 3}, "param 'source_uri': must be empty or a string, got 3 (int)"),
    ({"source_uri": "/data/day.tsv"}, "param 'source_uri': '/data/day.tsv' names no day: put {ds}"),
    ({"holdout": "last_day"}, "param 'holdout': must be one of 'next_day' or 'split', got 'last_day'"),
    ({"preprocessing": "co-run"}, "param 'preprocessing': must be one of 'auto', 'inline', 'corun' or 'offline', "
                                  "got 'co-run'"),
    ({"resources_policy": "elastic"}, "param 'resources_policy': must be one of 'static' or 'dlrover', got 'elastic'"),
    ({"dataset_schema": "criteo"}, "param 'dataset_schema': dataset 'criteo' is neither a shipped schema"),
])
def test_a_bad_value_is_named(conf, message):
    with pytest.raises(ParamError, match=re.escape(message)):
        config_from_params(conf)


def test_every_bad_value_is_named_at_once():
    with pytest.raises(ParamError) as info:
        config_from_params({"workers": 0, "seed": "x", "warm_start": "always"})
    assert [p.split(":")[0] for p in str(info.value).split("; ")] \
        == ["param 'seed'", "param 'warm_start'", "param 'workers'"]


def test_an_integral_number_is_an_integer():
    assert config_from_params({"workers": 2.0}) == {"resources": {"workers": 2}}


def test_the_readme_options_table_is_the_generated_one():
    """README.md holds exactly the table `python -m recforge.pipelines.dag_tasks --markdown` prints."""
    text = README.read_text()
    begin = "<!-- params table: generated by `python -m recforge.pipelines.dag_tasks --markdown` -->\n"
    end = "<!-- end of params table -->"
    assert begin in text and end in text, "README.md lost the markers of its params table"
    table = text[text.index(begin) + len(begin):text.index(end)]
    assert table == params_markdown(), (
        "README.md's options table differs from the DAG's Params: regenerate it with "
        "`python -m recforge.pipelines.dag_tasks --markdown`")
    assert len(table.splitlines()) == len(PARAM_FIELDS) + 2
    out = subprocess.run([sys.executable, "-m", "recforge.pipelines.dag_tasks", "--markdown"], capture_output=True,
                         text=True, check=True, timeout=120)
    assert out.stdout == table


def test_the_deployments_landing_zone_is_the_source_uri_default(monkeypatch):
    """make up sets RECFORGE_SOURCE_URI: the form's source_uri default; a bad one fails naming the variable."""
    monkeypatch.setenv("RECFORGE_SOURCE_URI", "/srv/landing/day_{ds}.tsv.gz")
    assert default_params()["source_uri"]["default"] == "/srv/landing/day_{ds}.tsv.gz"
    assert "/srv/landing" not in params_markdown()  # the README's table shows the config's default
    monkeypatch.setenv("RECFORGE_SOURCE_URI", "")  # set but empty: synthetic days
    assert default_params()["source_uri"]["default"] is None
    monkeypatch.setenv("RECFORGE_SOURCE_URI", "/srv/landing/day.tsv.gz")
    with pytest.raises(ValueError, match=r"RECFORGE_SOURCE_URI='/srv/landing/day.tsv.gz': .* names no day"):
        default_params()
