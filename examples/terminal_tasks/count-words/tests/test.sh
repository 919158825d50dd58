#!/bin/bash
# reward.json: 1 when /app/words.txt holds the number of words in /app/notes, else 0
mkdir -p /logs/verifier
python3 - <<'PY'
import json, os, pathlib
notes = sorted(pathlib.Path("/app/notes").glob("*.txt"))
assert len(notes) == int(os.environ["EXPECTED_FILES"]), "the notes were changed"
expected = sum(len(p.read_text().split()) for p in notes)
answer = pathlib.Path("/app/words.txt")
right = answer.is_file() and answer.read_text().strip() == str(expected)
pathlib.Path("/logs/verifier/reward.json").write_text(json.dumps({"reward": 1.0 if right else 0.0}))
PY
