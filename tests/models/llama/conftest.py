import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # smollm_fixtures.py

from smollm_fixtures import smollm, smollm_path  # noqa: E402,F401
