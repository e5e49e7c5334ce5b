"""recforge.data: day-file readers of any schema (tsv/csv/parquet) with quarantine, synthetic generator,
Parquet shards + manifest."""
from recforge.data.encodings import string_id
from recforge.data.errors import DataError
from recforge.data.generator import GeneratorReport, auc, generate_days
from recforge.data.ingest import ingest
from recforge.data.manifest import Manifest, ShardInfo, SourceStats
from recforge.data.quarantine import Quarantine
from recforge.data.reader import parse_line_reference, read_criteo, read_source
from recforge.data.reader_text import parse_row_reference
from recforge.data.schema import arrow_schema, column_names
from recforge.data.shards import read_rows

__all__ = [
    "DataError",
    "GeneratorReport",
    "Manifest",
    "Quarantine",
    "ShardInfo",
    "SourceStats",
    "arrow_schema",
    "auc",
    "column_names",
    "generate_days",
    "ingest",
    "parse_line_reference",
    "parse_row_reference",
    "read_criteo",
    "read_rows",
    "read_source",
    "string_id",
]
