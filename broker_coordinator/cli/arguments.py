"""Argument types the `broker-coordinator` subcommands share: each parses one option's text or
raises argparse.ArgumentTypeError with what is wrong."""

from __future__ import annotations

import argparse

from edgefl_protocol import topics
from edgefl_models import partition


def bounded(kind: type, low: float, high: float | None = None):  # noqa: ANN202
    """An argparse type: `kind(text)` between `low` and `high` (None: no upper bound)."""
    def parse(text: str):  # noqa: ANN202
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if value < low or (high is not None and value > high):
            span = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"{value} is out of range: must be {span}")
        return value
    return parse


def partition_spec(text: str) -> str:
    try:
        partition.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def hparam(text: str) -> tuple[str, float | str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        return key, float(value)
    except ValueError:
        return key, value


def codec_spec(text: str) -> str:
    from edgefl_protocol import codec
    try:
        return codec.parse(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def uplink_codec_spec(text: str) -> str:
    from edgefl_protocol import codec
    return codec.AUTO if text == codec.AUTO else codec_spec(text)


def checked_by(check):  # noqa: ANN001, ANN202
    """An argparse type that keeps the text once `check(text)` accepts it (its ValueError is the message)."""
    def parse(text: str) -> str:
        try:
            check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text
    return parse


def federation_name(text: str) -> str:
    try:
        return topics.check_name("federation", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
