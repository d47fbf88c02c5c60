"""The service commands' settings: defaults shown in ``--help``, a config file, logging.

``router-sim serve --config FILE`` reads a TOML file whose keys are the command's long options
(``health-interval = 0.2`` or ``health_interval = 0.2``); an option given on the command line
wins over the file, the file over the built-in default. To know which options were given, the
parser's defaults are moved aside (:func:`defer_defaults`): an option left out parses as
:data:`UNSET`, and :func:`resolve` fills it from the file or the default. Every option's help
ends with its default.

Logging (``--log-level``): one line per record on stderr, with its time and level.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
from pathlib import Path
from typing import Any, Final

import tomllib

from events.tools.limits import InputTooLarge, read_bounded_bytes

LOG_LEVELS: Final = ("debug", "info", "warning", "error")
LOG_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"
MAX_CONFIG_BYTES: Final = 1 << 20


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset()
_DEFAULTS_KEY: Final = "_deferred_defaults"
_NOT_IN_FILE: Final = frozenset({"help", "config", "command"})


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the key."""


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    # argparse offers no public list of a parser's actions
    return [a for a in parser._actions if a.option_strings and a.dest not in _NOT_IN_FILE]


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """End each option's help with its default."""
    for action in _options(parser):
        default = action.default
        if action.help is not None and action.help is not argparse.SUPPRESS:
            shown = "none" if default is None else ("off" if default is False else default)
            if isinstance(default, list):
                shown = ", ".join(map(str, default)) or "none"
            action.help = f"{action.help} (default: {shown})".replace("%", "%%")


def defer_defaults(parser: argparse.ArgumentParser) -> None:
    """:func:`show_defaults`, then replace the defaults by :data:`UNSET` (kept aside for
    :func:`resolve`)."""
    show_defaults(parser)
    defaults: dict[str, Any] = {}
    actions: dict[str, argparse.Action] = {}
    for action in _options(parser):
        defaults[action.dest] = action.default
        actions[action.dest] = action
        action.default = UNSET
    parser.set_defaults(**{_DEFAULTS_KEY: (defaults, actions)})


def _load(path: str) -> dict[str, Any]:
    p = Path(path)
    try:
        if p.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {path} is over {MAX_CONFIG_BYTES} bytes")
        # read within the cap too: a device or a pipe reports size 0
        data = read_bounded_bytes(p, "config file", MAX_CONFIG_BYTES)
        return tomllib.loads(data.decode("utf-8"))
    except InputTooLarge as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not TOML: {exc}") from None


def _typed(path: str, key: str, value: Any, action: argparse.Action, default: Any) -> Any:
    kind: type = bool if action.nargs == 0 else str  # a switch (store_true), or text
    if action.nargs != 0 and isinstance(action.type, type):
        kind = action.type
    elif action.nargs != 0 and default is not None:
        kind = type(default)
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        name = getattr(kind, "__name__", str(kind))
        raise ConfigError(f"{path}: {key} wants a {name}, got {value!r}")
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{path}: {key} must be one of {choices}; got {value!r}")
    return value


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every option left :data:`UNSET`: from the config file (``args.config``) when it
    sets it, else the built-in default (:class:`ConfigError` for a key that is not an option
    or a bad value)."""
    config: str | None = getattr(args, "config", None)
    deferred = getattr(args, _DEFAULTS_KEY, None)
    if deferred is None:
        return args
    defaults, actions = deferred
    given: dict[str, Any] = {}
    if config is not None:
        for key, value in _load(config).items():
            dest = key.replace("-", "_")
            if dest not in actions:
                options = sorted(k.replace("_", "-") for k in actions)
                near = difflib.get_close_matches(key.replace("_", "-"), options, n=1)
                hint = f" (did you mean {near[0]}?)" if near else ""
                raise ConfigError(f"{config}: {key} is not an option of this command{hint}")
            given[dest] = _typed(config, key, value, actions[dest], defaults[dest])
    for dest, default in defaults.items():
        if getattr(args, dest, UNSET) is UNSET:
            setattr(args, dest, given.get(dest, default))
    delattr(args, _DEFAULTS_KEY)
    return args


def setup_logging(level: str) -> None:
    """Every record on stderr as ``time LEVEL logger: message``."""
    logging.basicConfig(
        level=getattr(logging, level.upper()), format=LOG_FORMAT, stream=sys.stderr, force=True
    )
