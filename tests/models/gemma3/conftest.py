import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # harness.py, prompts.py

from gemma_fixtures import gemma, gemma_path, gemma_tokenizer  # noqa: E402,F401
