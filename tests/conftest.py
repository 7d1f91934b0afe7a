import os
import sys

import pytest
import torch

# Rank processes are spawned: they import worker functions from this folder by module name.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    # GPU tests skip cleanly (and visibly) on machines without a CUDA device.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
