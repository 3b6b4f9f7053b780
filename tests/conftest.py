import pytest
import torch


@pytest.fixture
def single_thread():
    """Run a test on one intra-op thread.

    gradcheck makes thousands of calls on tiny tensors; with several OpenMP threads on a busy
    CPU each call pays for thread hand-offs, and the test gets ~30x slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
