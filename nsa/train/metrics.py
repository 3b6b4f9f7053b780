"""Where training reports go: JSON lines in the run directory (and optionally TensorBoard and
Weights & Biases) and a progress display."""

from __future__ import annotations

import json
from pathlib import Path

METRICS = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_RUN_ID = "wandb_run_id"


class MetricsLog:
    """One JSON object per line in ``run_dir/metrics.jsonl``; every record has a ``step``.

    Opening it for a run that starts after ``start_step`` steps keeps only the records up to
    that step: the ones a crashed run wrote after its last checkpoint are about to be redone.

    Optional sinks get the numeric fields of every record as scalars at ``record["step"]``:
    ``tensorboard=True`` writes event files to ``run_dir/tensorboard`` (and hides the events a
    crashed run wrote after ``start_step``); ``wandb_project`` logs to Weights & Biases, with
    ``wandb_config`` (the run's configuration) attached. :meth:`close` finishes them.
    """

    def __init__(self, run_dir: Path, start_step: int, *, tensorboard: bool = False,
                 wandb_project: str | None = None, wandb_config: dict | None = None):
        self.path = run_dir / METRICS
        kept = [r for r in read_metrics(self.path) if r["step"] <= start_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.sinks: list[TensorBoardSink | WandbSink] = []
        if tensorboard:
            self.sinks.append(TensorBoardSink(run_dir, start_step))
        if wandb_project is not None:
            self.sinks.append(WandbSink(run_dir, start_step, wandb_project, wandb_config))

    def log(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.sinks:
            scalars = {key: value for key, value in record.items()
                       if key != "step" and isinstance(value, (int, float))
                       and not isinstance(value, bool)}
            for sink in self.sinks:
                sink.log(scalars, record["step"])

    def close(self) -> None:
        """Finish the optional sinks (the JSON lines need nothing)."""
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class TensorBoardSink:
    """Scalars into ``run_dir/tensorboard``, flushed at every record like the JSON lines.

    ``purge_step`` makes TensorBoard hide what an earlier run in the directory wrote at steps
    after ``start_step``: the records a crashed run made past its checkpoint, or all of an
    overwritten run's.
    """

    def __init__(self, run_dir: Path, start_step: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError("tensorboard=True needs the tensorboard package "
                              "(pip install tensorboard)") from error
        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR),
                                    purge_step=start_step + 1)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Scalars to a Weights & Biases run, resumed with the run: its id is kept in
    ``run_dir/wandb_run_id``. W&B steps only go forward, so on a resume it drops the records of
    steps it already has (those a crashed run logged after its checkpoint)."""

    def __init__(self, run_dir: Path, start_step: int, project: str, config: dict | None):
        try:
            import wandb
        except ImportError as error:
            raise ImportError(f"wandb_project={project!r} needs the wandb package "
                              "(pip install wandb)") from error
        id_path = run_dir / WANDB_RUN_ID
        if start_step > 0 and id_path.is_file():
            run_id = id_path.read_text().strip()
        else:
            run_id = wandb.util.generate_id()
            id_path.write_text(run_id + "\n")
        self.run = wandb.init(project=project, name=run_dir.name, id=run_id, resume="allow",
                              dir=str(run_dir), config=config)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics file (none if it does not exist; a torn last line is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class Progress:
    """A tqdm bar when tqdm is installed, else one printed line per update."""

    def __init__(self, start: int, total: int):
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        self.total = total
        self.bar = None if tqdm is None else tqdm(initial=start, total=total, unit="step",
                                                  dynamic_ncols=True)

    def update(self, step: int, summary: str) -> None:
        if self.bar is None:
            print(f"step {step}/{self.total} | {summary}", flush=True)
            return
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix_str(summary)

    def write(self, message: str) -> None:
        if self.bar is None:
            print(message, flush=True)
        else:
            self.bar.write(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
