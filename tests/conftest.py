import os

import pytest
import torch

CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    slow_enabled = os.environ.get("TORCHREPLAY_SLOW", "0") == "1"
    for item in items:
        if "cuda" in item.keywords and not CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (none on this machine)"))
        if "slow" in item.keywords and not slow_enabled:
            item.add_marker(pytest.mark.skip(reason="stress/scale run: set TORCHREPLAY_SLOW=1"))
