"""Fixtures shared by the test modules."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One torch intra-op thread for the module's tests, restored afterwards: the tests' models are tiny, and on a
    shared 2-core machine a second thread only adds contention (several times slower). Use it with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
