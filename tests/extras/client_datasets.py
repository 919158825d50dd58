"""agentjet-client[datasets] alone: tasks from a Parquet file and from a dataset saved with save_to_disk."""

import tempfile
from pathlib import Path

import datasets
import pyarrow
import pyarrow.parquet

from agentjet_client.tasks.sources import read_rows

rows = [{"id": f"t{i}", "question": f"{i} + 1", "answer": str(i + 1)} for i in range(5)]
work = Path(tempfile.mkdtemp(prefix="agentjet-smoke-datasets-"))
pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), work / "tasks.parquet")
assert read_rows(work / "tasks.parquet") == rows
datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(work / "saved"))
assert read_rows(work / "saved", "train") == rows
print("datasets: a Parquet file and a saved dataset read as tasks")
