"""The client image's health check: the run touches its heartbeat file every second while it goes on."""

import os
import sys
import time

path = os.environ.get("AGENTJET_CLIENT_HEARTBEAT_FILE", "/tmp/agentjet-heartbeat")
try:
    sys.exit(0 if time.time() - os.path.getmtime(path) < 60 else 1)
except OSError:  # not started yet
    sys.exit(1)
