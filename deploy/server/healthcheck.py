"""The server image's health check: /healthz on the local port answers 200 once the server serves."""

import os
import sys
import urllib.request

port = os.environ.get("AGENTJET_SERVER_PORT", "8000")
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=4) as answer:
        sys.exit(0 if answer.status == 200 else 1)
except OSError:  # refused, 503 while starting, timed out
    sys.exit(1)
