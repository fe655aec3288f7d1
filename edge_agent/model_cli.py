"""`edge-agent model show | export | predict`: the serving store, read by the device's operator and
applications. These commands read the store only; they never talk to the broker."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from .enroll import DEFAULT_CONFIG


def add_model_commands(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser("model", help="the model this device serves to its applications: show, export, predict",
                           description="Read the serving store ([serving] dir in agent.toml): the current version "
                                       "and its metadata, a copy of its files, or its predictions for a file.")
    actions = model.add_subparsers(dest="action", required=True)

    def store_options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                            help="the agent config naming the store (default: %(default)s)")
        parser.add_argument("--dir", type=Path, default=None,
                            help="the serving store itself, instead of reading it from --config (for users "
                                 "who may read the store but not the config)")

    show = actions.add_parser("show", help="the current version, its metadata and the versions kept",
                              description="Print the current version, its metadata.json and the versions kept.")
    store_options(show)
    show.set_defaults(handler=run_show)
    export = actions.add_parser("export", help="copy the current version's files (model.pt, model.onnx, metadata.json)",
                                description="Copy the current version's model.pt, its model.onnx where the store "
                                            "has one, and its metadata.json into OUT (a directory, created if "
                                            "needed).")
    export.add_argument("out", type=Path, metavar="OUT")
    store_options(export)
    export.set_defaults(handler=run_export)
    predict = actions.add_parser("predict", help="predict with the current version; one JSON line per sample",
                                 description="Run the current version on FILE (an .npz with an array x, or an "
                                             ".npy) and print one JSON line per sample: the predicted class "
                                             "(classification) or value(s) (regression).")
    predict.add_argument("file", type=Path, metavar="FILE")
    store_options(predict)
    predict.set_defaults(handler=run_predict)


def _fail(message: str) -> int:
    print(f"edge-agent: error: {message}", file=sys.stderr)
    return 2


def _store_dir(args: argparse.Namespace) -> Path:
    if args.dir is not None:
        return args.dir
    from .config import load_config
    directory = load_config(args.config).serving.dir
    if not directory:
        raise ValueError(f"{args.config}: [serving] dir is \"\": this device keeps no serving store")
    return Path(directory)


def _current(args: argparse.Namespace) -> tuple[Path, str, dict]:
    from .serving import read_current
    root = _store_dir(args)
    target, meta, _ = read_current(root)
    return root, target, meta


def _errors() -> tuple[type[BaseException], ...]:
    from edgefl_protocol.settings import ConfigError

    from .serving_store import StoreError
    return ConfigError, StoreError, ValueError, OSError


def run_show(args: argparse.Namespace) -> int:
    from .serving_store import ServingStore
    try:
        root, target, meta = _current(args)
        kept = ServingStore(root).versions()
    except _errors() as exc:
        return _fail(str(exc))
    score = meta.get("score")
    scored = f"{score['metric']} {score['value']:.4g} on {score['count']} held-out samples" if score else "not scored"
    print(f"store:    {root}")
    print(f"current:  version {target} (round {meta.get('round')}, {meta.get('architecture')}, {scored}, "
          f"published {meta.get('published_at')})")
    print(f"kept:     {', '.join(map(str, kept))}")
    print("metadata: " + json.dumps(meta, indent=2, sort_keys=True).replace("\n", "\n          "))
    return 0


def run_export(args: argparse.Namespace) -> int:
    from .serving_store import METADATA, ONNX, WEIGHTS
    try:
        root, target, _ = _current(args)
        args.out.mkdir(parents=True, exist_ok=True)
        names = [name for name in (WEIGHTS, ONNX, METADATA) if name != ONNX or (root / target / ONNX).exists()]
        for name in names:
            shutil.copyfile(root / target / name, args.out / name)
    except _errors() as exc:
        return _fail(str(exc))
    print(f"exported version {target} to {args.out} ({', '.join(names)})")
    return 0


def run_predict(args: argparse.Namespace) -> int:
    import numpy as np

    from .serving import ServedModel
    try:
        loaded = np.load(args.file, allow_pickle=False)
        if isinstance(loaded, np.lib.npyio.NpzFile):
            if "x" not in loaded:
                return _fail(f"{args.file} has no array named x (it has: {', '.join(loaded.files) or 'none'})")
            loaded = loaded["x"]
        predictions = ServedModel(_store_dir(args)).predict(loaded)
    except _errors() + (RuntimeError,) as exc:
        return _fail(f"{args.file}: {exc}")
    for value in predictions.tolist():
        print(json.dumps(value))
    return 0
