"""``nsa train`` with one injected fault, for tests/train/test_faults.py (alone or under torchrun).

    python tests/train/fault_runner.py --fault kill --rank 1 --step 5 --marker M -- <train args>

Faults: ``kill`` (SIGKILL at the start of the step), ``stall`` (sleeps forever inside the loss
all-reduce, a collective), ``nan`` (NaN in this rank's gradients), ``kill-in-save`` (SIGKILL
after the checkpoint's shards are written, before it is complete). A fault fires once: the
marker file is written first, so a restarted job runs clean.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch

import nsa.cli
import nsa.train.checkpoint as checkpoint
import nsa.train.trainer as trainer


def injected_stall() -> None:
    while True:
        time.sleep(3600)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", choices=("kill", "stall", "nan", "kill-in-save"), required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--step", type=int, required=True)
    parser.add_argument("--marker", type=Path, required=True)
    separator = sys.argv.index("--")
    args = parser.parse_args(sys.argv[1:separator])
    train_args = sys.argv[separator + 1:]
    armed = int(os.environ.get("RANK", "0")) == args.rank and not args.marker.exists()
    state = {"step": 0, "nan": False}

    def fire() -> None:
        args.marker.write_text(f"{args.fault} at step {args.step}\n")

    set_learning_rate = trainer.set_learning_rate

    def set_learning_rate_with_fault(optimizer, step, t):
        state["step"] = step
        if armed and step == args.step:
            if args.fault == "kill":
                fire()
                os.kill(os.getpid(), signal.SIGKILL)
            if args.fault == "nan":
                fire()
                state["nan"] = True
        return set_learning_rate(optimizer, step, t)

    clip = torch.nn.utils.clip_grad_norm_

    def clip_with_nan(parameters, max_norm, *a, **k):
        parameters = list(parameters)
        if state["nan"]:
            state["nan"] = False
            parameters[0].grad.fill_(float("nan"))
        return clip(parameters, max_norm, *a, **k)

    all_reduce_mean = trainer.all_reduce_mean

    def all_reduce_with_stall(x, ctx):
        if armed and args.fault == "stall" and state["step"] == args.step:
            fire()
            injected_stall()
        return all_reduce_mean(x, ctx)

    write_manifest = checkpoint.write_manifest

    def write_manifest_with_kill(path):
        if armed and args.fault == "kill-in-save" and state["step"] == args.step:
            fire()
            os.kill(os.getpid(), signal.SIGKILL)
        write_manifest(path)

    trainer.set_learning_rate = set_learning_rate_with_fault
    torch.nn.utils.clip_grad_norm_ = clip_with_nan
    trainer.all_reduce_mean = all_reduce_with_stall
    checkpoint.write_manifest = write_manifest_with_kill
    nsa.cli.main(["train", *train_args])


if __name__ == "__main__":
    main()
