import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # server_fixtures.py

from server_fixtures import client, llm, offline, offline_long, server  # noqa: E402,F401
