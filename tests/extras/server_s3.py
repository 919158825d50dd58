"""agentjet-server[s3] alone: --checkpoint-uri s3://'s store puts, lists and reads back objects on a local
S3 server (moto, started by scripts/extras.py from the test environment)."""

import json
import os
import tempfile
import uuid
from pathlib import Path

import s3fs

from agentjet_server.state.objectstore import open_store

endpoint = os.environ["AGENTJET_SMOKE_S3"]
os.environ.setdefault("AWS_ACCESS_KEY_ID", "smoke")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "smoke")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
bucket = f"smoke-{uuid.uuid4().hex[:8]}"
s3fs.S3FileSystem(endpoint_url=endpoint).mkdir(bucket)
options = Path(tempfile.mkdtemp(prefix="agentjet-smoke-s3-")) / "options.json"
options.write_text(json.dumps({"endpoint_url": endpoint}))
store = open_store(f"s3://{bucket}/run", options)
store.put("log/0/0-10.part", b"0123456789")
assert store.list("log/") == {"log/0/0-10.part": 10}, store.list("log/")
assert store.get("log/0/0-10.part") == b"0123456789"
print(f"s3: put, list and get on s3://{bucket}/run")
