"""The sinks of the optional requirements-loggers.txt: Weights & Biases ("wandb") and MLflow ("mlflow") in log.sinks.
Imported only when log.sinks names one; each package only when its sink opens. Each gets every numeric field of each
step record under the TensorBoard tags (accumulation/run/sinks.py), at x = steps.

Nothing is uploaded unless the user asks: W&B runs offline (files under WANDB_DIR, `wandb sync` uploads them later)
unless WANDB_MODE says otherwise; MLflow writes where MLFLOW_TRACKING_URI points, which must be set.
Neither can delete points: after a resume, the steps after the checkpoint appear a second time there (metrics.jsonl
and TensorBoard drop the first copies)."""

import importlib.util
import os

from accumulation.config.config import config_to_dict
from accumulation.config.registry import register_sink
from accumulation.run.sinks import SinkSession, tagged


def package_check(sink: str, package: str, environment: str = ""):
    """check(config) for register_sink: the package installed (and `environment` set, when given), or one line
    saying what to do."""

    def check(config) -> None:
        if importlib.util.find_spec(package) is None:
            raise ValueError(
                f"{sink} needs the optional {package} package: pip install -r requirements-loggers.txt "
                f"(or leave {sink} out of log.sinks)"
            )
        if environment and not os.environ.get(environment):
            raise ValueError(
                f"{sink} writes where {environment} points, and it is not set: e.g. an MLflow server's "
                f"http://HOST:5000, or file:./mlruns with MLFLOW_ALLOW_FILE_STORE=true (mlflow-skinny has no "
                f"database backend)"
            )

    return check


class WeightsAndBiases:
    def __init__(self, session: SinkSession) -> None:
        import wandb

        self.source_group = session.source_group
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "accumulation"),
            name=session.config.run.name,
            config=config_to_dict(session.config),
            mode=os.environ.get("WANDB_MODE", "offline"),  # "online" uploads: only when the user says so
            settings=wandb.Settings(console="off"),  # the terminal's lines stay the run's own
        )

    def write(self, record: dict) -> None:
        self.run.log(tagged(record, self.source_group), step=record["steps"])

    def flush(self) -> None:
        pass  # W&B's own process writes each record as it comes

    def close(self) -> None:
        self.run.finish()


class MLflow:
    def __init__(self, session: SinkSession) -> None:
        import mlflow

        self.mlflow, self.source_group = mlflow, session.source_group
        self.run = mlflow.start_run(run_name=session.config.run.name)
        mlflow.log_dict(config_to_dict(session.config), "config.json")

    def write(self, record: dict) -> None:
        self.mlflow.log_metrics(tagged(record, self.source_group), step=record["steps"], run_id=self.run.info.run_id)

    def flush(self) -> None:
        pass  # MLflow's client writes each call through

    def close(self) -> None:
        self.mlflow.end_run()


register_sink("wandb", WeightsAndBiases, check=package_check("wandb", "wandb"))
register_sink("mlflow", MLflow, check=package_check("mlflow", "mlflow", environment="MLFLOW_TRACKING_URI"))
