"""metrics.jsonl as a resume finds it: read and checked line by line, then cut back to the checkpoint's step.
Imported only when the run directory already holds a metrics file (logs.py) and by a resume (resume.py)."""

import json
from pathlib import Path

from accumulation.run.checkpoint import WriteError
from accumulation.run.run_dir import RunDirectoryError, write_text_atomically
from accumulation.run.write_errors import why_not_written


def metrics_lines(metrics_path: Path) -> list[tuple[int, str]]:
    """(step, line) for each complete line of an existing metrics.jsonl, read before a resume rewrites it.
    A last line without its newline was cut short by a process killed while writing it: not a record, left
    out. Any other line that is not a JSON object with an integer "steps" is damage a person must look at:
    RunDirectoryError naming the line."""
    if not metrics_path.exists():
        return []
    try:
        text = metrics_path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise RunDirectoryError(f"{metrics_path} cannot be read ({error}); fix or delete the file") from None
    found, previous_number = [], None  # previous_number: the line of found[-1]
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        if not line.endswith("\n") or not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            record = error
        if not isinstance(record, dict) or type(record.get("steps")) is not int:
            problem = f"not JSON ({record})" if isinstance(record, ValueError) else 'not an object with "steps"'
            raise RunDirectoryError(
                f"{metrics_path} line {number} is {problem}; the resume keeps the lines up to the checkpoint and "
                f"cannot tell which step this one is: repair or delete that line (or move the file away to start "
                f"the metrics afresh), then start again"
            )
        if found and record["steps"] <= found[-1][0]:  # one line per step, in order: a repeat would survive
            raise RunDirectoryError(
                f"{metrics_path} line {number} is of step {record['steps']}, after line {previous_number} of step "
                f"{found[-1][0]}; the file holds one line per step, in order: repair or delete that line (or move the "
                f"file away to start the metrics afresh), then start again"
            )
        found.append((record["steps"], line))
        previous_number = number
    return found


def keep_metrics_up_to(metrics_path: Path, steps: int) -> None:
    """On resume, drop metric lines of steps after the checkpoint (they will be run again), so the file
    holds exactly one line per step. Rewritten atomically: the old file stays whole until the rename."""
    kept = [line for step, line in metrics_lines(metrics_path) if step <= steps]
    try:
        write_text_atomically(metrics_path, "".join(kept))
    except OSError as error:
        raise WriteError(
            f"{metrics_path} could not be rewritten for the resume: {why_not_written(error, metrics_path.parent)}; "
            f"the file is unchanged"
        ) from None


def drop_last_step_validation(metrics_path: Path, steps: int, eval_every: int) -> dict | None:
    """A run extended past its old run.max_steps, resumed from the checkpoint of its old last step: that step's line
    holds a val_loss only because it was the last (train.py validates the last step). Off the run.eval_every cadence
    it goes, so that the extended run's lines are an uninterrupted run's. Returns the revised record (the sinks
    write it again), or None when the line is left as it was."""
    lines = metrics_lines(metrics_path)
    if not lines or lines[-1][0] != steps or (eval_every > 0 and steps % eval_every == 0):
        return None
    record = json.loads(lines[-1][1])
    if "val_loss" not in record:
        return None
    del record["val_loss"]
    try:
        write_text_atomically(metrics_path, "".join(line for _, line in lines[:-1]) + json.dumps(record) + "\n")
    except OSError as error:
        raise WriteError(
            f"{metrics_path} could not be rewritten for the resume: {why_not_written(error, metrics_path.parent)}; "
            f"the file is unchanged"
        ) from None
    return record
