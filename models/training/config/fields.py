"""What every section of the job config shares: a field whose flag is named otherwise, the flag of a field, and the
value checks whose one-line errors name that flag."""
import dataclasses
from typing import Any


def flag_field(default: Any, *, flag: str) -> Any:
    """A field whose command-line flag is named otherwise (--FLAG)."""
    return dataclasses.field(default=default, metadata={"flag": flag})


def dest(field: dataclasses.Field) -> str:
    """The argparse dest of a section's field: its own name unless it says otherwise."""
    return field.metadata.get("flag", field.name)


def flag_of(name: str) -> str:
    """The command-line flag of a field name (dashes for underscores)."""
    return f"--{name.replace('_', '-')}"


def at_least(section: Any, names: tuple[str, ...], low: int) -> None:
    for name in names:
        value = getattr(section, name)
        if value is not None and value < low:
            raise ValueError(f"{flag_of(name)}={value} must be >= {low}")


def one_of(flag: str, value: Any, allowed: tuple) -> None:
    """(argparse checks the flags' choices; this, a TOML file's)"""
    if value not in allowed:
        raise ValueError(f"{flag}={value} must be one of {', '.join(map(str, allowed))}")
