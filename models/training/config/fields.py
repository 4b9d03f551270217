"""What every section of the job config shares: `option`, a field with its command-line flag described in its metadata
(models/training/flags.py builds `python -m models.train`'s parser from them), the flag of a field, and the value
checks whose one-line errors name that flag."""
import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any


def option(default: Any = None, help: str = "", *, flag: str | None = None, aliases: tuple[str, ...] = (),
           consts: Mapping[str, Any] | None = None, choices: Iterable | None = None, metavar: str | None = None,
           path: bool = False, hidden: bool = False, bare: Any = None) -> Any:
    """A field of a job-config section and its flag: --FLAG (default: the field's name, dashes for underscores) taking
    a value of the field's type, `default` shown by --help unless None or False. `aliases`: other flags of the same
    meaning (Megatron-LM's names); `consts`: flags that set one value ({"--bf16": "bf16"}); `choices`: the allowed
    values (a tuple, or a registry whose keys are); `path`: a file or directory, written absolute into the config a
    run saves; `hidden`: left out of --help (the tests' fault injection); `bare`: the value the flag given alone
    means (its value then optional: `--compile` is `--compile on`)."""
    metadata = {"help": help, "aliases": aliases, "consts": dict(consts or {}), "choices": choices,
                "metavar": metavar, "path": path, "hidden": hidden, "bare": bare}
    if flag is not None:
        metadata["flag"] = flag
    return dataclasses.field(default=default, metadata=metadata)


def dest(field: dataclasses.Field) -> str:
    """The argparse dest of a section's field: its own name unless it says otherwise."""
    return field.metadata.get("flag", field.name)


def flag_of(name: str) -> str:
    """The command-line flag of a field name (dashes for underscores)."""
    return f"--{name.replace('_', '-')}"


def absolute(path: str | list[str]) -> str | list[str]:
    """A path field's value with its relative paths made absolute: a path, or a list of them (--data's: one PATH, or
    WEIGHT PATH pairs, whose weights stay as they are)."""
    if isinstance(path, str):
        return os.path.abspath(path)
    return [os.path.abspath(item) if len(path) == 1 or i % 2 else item for i, item in enumerate(path)]


def at_least(section: Any, names: tuple[str, ...], low: int) -> None:
    for name in names:
        value = getattr(section, name)
        if value is not None and value < low:
            raise ValueError(f"{flag_of(name)}={value} must be >= {low}")


def one_of(flag: str, value: Any, allowed: tuple) -> None:
    """(argparse checks the flags' choices; this, a TOML file's)"""
    if value not in allowed:
        raise ValueError(f"{flag}={value} must be one of {', '.join(map(str, allowed))}")
