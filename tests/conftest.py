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


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """An untrained run of the tiny preset (bytes tokenizer, max_seq_len 128) with one
    checkpoint, shared by the command-line and Hugging Face tests."""
    from nsa.models import LanguageModel
    from nsa.train import build_config
    from nsa.train.checkpoint import save_checkpoint
    from nsa.train.distributed import DistContext
    from nsa.train.trainer import build_optimizer

    path = tmp_path_factory.mktemp("runs") / "tiny"
    config = build_config("tiny", [f"run_dir={path}"])
    torch.manual_seed(0)
    model = LanguageModel(config.model)
    single = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    save_checkpoint(path, 1, model, build_optimizer(model, config.train), config, {}, single,
                    keep=1)
    return path
