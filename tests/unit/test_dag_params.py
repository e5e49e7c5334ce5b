"""The daily DAG's Params <-> PipelineConfig, and trigger conf keys the DAG does not know."""
from __future__ import annotations

import pytest

from recforge.config import PipelineConfig
from recforge.pipelines.dag_tasks import PARAM_FIELDS, config_from_params, default_params


def test_every_param_maps_to_a_config_field_and_defaults_round_trip():
    params = {name: spec["default"] for name, spec in default_params().items()}
    assert set(params) == set(PARAM_FIELDS)
    cfg = PipelineConfig.model_validate(config_from_params(params))
    assert cfg == PipelineConfig()  # the DAG's defaults are the config's defaults


def test_params_nest_into_the_config():
    cfg = PipelineConfig.model_validate(config_from_params(
        {"workers": 3, "batch_size": 32, "model_arch": "dlrm_dcn", "preprocessing": "corun", "source_dir": "",
         "corun_mapping": False}))
    assert (cfg.resources.workers, cfg.train.batch_size, cfg.model.arch, cfg.preprocessing) \
        == (3, 32, "dlrm_dcn", "corun")
    assert cfg.corun.mapping is False  # a boolean False is a setting, not "not set"
    assert cfg.source_dir is None  # an empty form field means "not set"


def test_an_unknown_conf_key_is_named():
    with pytest.raises(ValueError, match=r"unknown recforge_daily param\(s\) \['row_per_day'\]"):
        config_from_params({"row_per_day": 1000, "workers": 2})
