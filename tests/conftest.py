import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (set before anything imports them).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
