"""Argument types shared by the sub-commands' parsers (``type=`` of ``add_argument``)."""

from __future__ import annotations

import argparse
import json

import torch

from compile_runtime.platforms.select import platform_for


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def string_list(text: str) -> list[str]:
    """A JSON list of strings (as vLLM takes ``--allowed-origins``) or comma-separated ones."""
    if text.lstrip().startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {e}") from None
        if not all(isinstance(v, str) for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: give a JSON list of strings")
        return values
    return [v.strip() for v in text.split(",") if v.strip()]


def positive_int_list(text: str) -> tuple[int, ...]:
    """``"16,14"`` -> ``(16, 14)``."""
    return tuple(positive_int(part.strip()) for part in text.split(","))


def int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is not >= {minimum}")
        return value

    return parse


def float_in(low: float, high: float, low_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (low < value <= high if low_open else low <= value <= high):
            raise argparse.ArgumentTypeError(
                f"{value} is not in {'(' if low_open else '['}{low}, {high}]"
            )
        return value

    return parse


def device(text: str) -> str:
    """A device this machine has: ``cpu``, ``cuda`` or ``cuda:N``."""

    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    try:
        platform = platform_for(device) if device is not None else None
    except ValueError:
        platform = None
    if platform is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu, cuda or cuda:N")
    if (why := platform.missing_device(device)) is not None:
        raise argparse.ArgumentTypeError(f"{text}: {why}; use --device cpu or a lower index")
    return text
