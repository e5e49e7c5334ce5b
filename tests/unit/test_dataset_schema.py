"""Dataset schema files: the shipped Criteo schemas, a user's schema, and every schema error naming the field."""
from __future__ import annotations

import textwrap

import pytest

from recforge.config import (
    DATASET_PRESETS,
    DatasetConfig,
    MultiHotFeature,
    PipelineConfig,
    criteo_kaggle_dataset,
    load_dataset,
    load_dataset_file,
)

USER_SCHEMA = """
name: clicks_csv
format: csv
header: true
columns:
  - {name: id, role: ignore}
  - {name: hour, role: timestamp, format: "%y%m%d%H"}
  - {name: click, role: label, positive: ["1", "yes"], negative: ["0", "no"]}
  - {name: price, role: dense, dtype: float, transform: none, clip: [0, 1000]}
  - {name: visits, role: dense}
  - {name: site_id, role: categorical, encoding: string, cardinality: 5000}
  - {name: banner_pos, role: categorical, encoding: int}
  - {name: tags, role: multi_hot, encoding: string, delimiter: "|", max_length: 5}
"""


def _write(tmp_path, text: str):
    p = tmp_path / "schema.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_shipped_criteo_schemas_are_files_with_the_criteo_layout():
    kaggle = load_dataset("criteo_kaggle")
    assert kaggle == criteo_kaggle_dataset()
    assert (kaggle.label, len(kaggle.dense), len(kaggle.sparse)) == ("label", 13, 26)
    assert kaggle.is_criteo_layout and kaggle.sparse[2].cardinality == 10131227
    tb = load_dataset("criteo_terabyte")
    assert tb.sparse[0].cardinality == 45833188 and tb.is_criteo_layout
    assert set(DATASET_PRESETS) >= {"criteo_kaggle", "criteo_terabyte"}


def test_user_schema_roles_and_views(tmp_path):
    ds = load_dataset(_write(tmp_path, USER_SCHEMA))
    assert ds.format == "csv" and ds.header and ds.field_delimiter == "," and ds.quote_char == '"'
    assert ds.label == "click" and ds.label_column.positive == ["1", "yes"]
    assert ds.dense_names == ["price", "visits"] and ds.dense[0].dtype == "float" and ds.dense[1].dtype == "int"
    assert ds.sparse_names == ["site_id", "banner_pos", "tags"]
    assert isinstance(ds.sparse[2], MultiHotFeature) and ds.sparse[2].multi_hot and ds.sparse[2].max_length == 5
    assert ds.sparse[1].cardinality is None and ds.sparse[1].table_rows(1000, 1) == 1000
    assert ds.sparse[0].table_rows(1000, 1) == 1000 and ds.sparse[0].table_rows(10**6, 1) == 5000
    assert ds.timestamp is not None and ds.timestamp.name == "hour"
    assert ds.field_names[0] == "id" and ds.num_fields == 8 and not ds.is_criteo_layout
    # round trip through JSON (the manifest stores the dataset)
    assert DatasetConfig.model_validate_json(ds.model_dump_json()) == ds
    assert PipelineConfig(dataset_schema=str(tmp_path / "schema.yaml")).dataset() == ds


def test_legacy_constructor_form_is_criteo_order():
    ds = DatasetConfig(name="x", dense=[{"name": "a"}], sparse=[{"name": "b", "cardinality": 3}])
    assert ds.field_names == ["label", "a", "b"] and ds.is_criteo_layout


@pytest.mark.parametrize(("text", "match"), [
    ("""
     name: d
     columns:
       - {name: y, role: label}
       - {name: c, role: categorical}
       - {name: c, role: dense}
     """, r"repeated: \['c'\]"),
    ("""
     name: d
     columns:
       - {name: y, role: label}
       - {name: c, role: feature}
     """, r"column 'c': unknown role 'feature'"),
    ("""
     name: d
     columns:
       - {name: y, role: label, positive: ["1", "0"], negative: ["0"]}
       - {name: c, role: categorical}
     """, r"column 'y': label values \['0'\] are both positive and negative"),
    ("""
     name: d
     columns:
       - {name: y, role: label}
       - {name: t, role: timestamp, format: "%Q-%m"}
       - {name: c, role: categorical}
     """, r"column 't': timestamp format '%Q-%m'"),
    ("""
     name: d
     columns:
       - {name: y, role: label}
       - {name: t, role: timestamp, format: "%H:%M"}
       - {name: c, role: categorical}
     """, r"column 't': timestamp format '%H:%M' does not give the date"),
    ("""
     name: d
     columns:
       - {name: y, role: label}
       - {name: c, role: categorical, encoding: base64}
     """, r"columns\[1\]\.encoding"),
    ("""
     name: d
     columns:
       - {name: y, role: label}
       - {name: c, role: categorical}
       - {name: z, role: label}
     """, r"exactly one label column, found 2"),
    ("""
     name: d
     format: parquet
     header: true
     columns:
       - {name: y, role: label}
       - {name: c, role: categorical}
     """, r"parquet reads columns by name"),
    ("""
     name: d
     format: csv
     columns:
       - {name: y, role: label}
       - {name: c, role: multi_hot, delimiter: ",", max_length: 3}
     """, r"column 'c': multi_hot delimiter ',' is the field delimiter"),
    ("""
     name: d
     columns:
       - {name: y, role: label}
       - {name: c, role: multi_hot}
     """, r"columns\[1\]\.max_length: Field required"),
    ("""
     name: d
     columns:
       - {name: y, role: label}
       - {name: c, role: categorical, hash: 3}
     """, r"columns\[1\]\.hash: Extra inputs"),
])
def test_bad_schema_names_the_column(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        load_dataset_file(_write(tmp_path, text))


def test_unknown_schema_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="neither a shipped schema"):
        load_dataset("criteo_nope")
    with pytest.raises(FileNotFoundError, match="dataset schema file not found"):
        load_dataset(tmp_path / "absent.yaml")
    with pytest.raises(ValueError, match="dataset_schema"):
        PipelineConfig(dataset_schema="criteo_nope")


def test_generator_refuses_schemas_it_cannot_write(tmp_path):
    from recforge.data.generator import generate_days

    with pytest.raises(ValueError, match="not in the Criteo layout"):
        generate_days(load_dataset(_write(tmp_path, USER_SCHEMA)), tmp_path / "raw", days=1, rows_per_day=10, seed=0)
    no_card = DatasetConfig(name="x", dense=[{"name": "a"}], sparse=[{"name": "b"}])
    with pytest.raises(ValueError, match=r"columns \['b'\] have no cardinality"):
        generate_days(no_card, tmp_path / "raw", days=1, rows_per_day=10, seed=0)


def test_schema_file_is_parsed_once_until_it_changes(tmp_path):
    path = _write(tmp_path, USER_SCHEMA)
    first, second = load_dataset(path), load_dataset(path)
    assert first == second and first is not second  # each caller gets its own copy of the cached schema
    first.columns.pop()
    assert load_dataset(path) == second  # mutating one copy does not reach the cache
    changed = USER_SCHEMA.replace("name: clicks_csv", "name: clicks_csv_v2")
    assert changed != USER_SCHEMA
    path.write_text(textwrap.dedent(changed))  # another size: a changed file is parsed again
    assert load_dataset(path).name == "clicks_csv_v2"
