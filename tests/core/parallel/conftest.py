import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # by_file.py


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model gains nothing from a second thread here, and on a busy host loses a lot (~5x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
