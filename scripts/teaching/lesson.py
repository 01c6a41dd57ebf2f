"""The command line the lesson scripts of docs/accumulation.md §24-§25 share (dropout_masks, clip_threshold,
scaler_run, packed_documents): measure, then print the lines the guide quotes, or the measurements as JSON."""

import argparse
import json
from collections.abc import Callable

import torch


def lesson_main(argv: list[str], description: str, measure: Callable[[], dict], report: Callable[[dict], list]) -> int:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the figures are float64 sums; one thread keeps their order the same run to run
    results = measure()
    print(json.dumps(results, indent=1) if args.json else "\n".join(report(results)))
    return 0
