"""The job config's TOML: a file's tables read, a field's value written, a value read checked against its field's
type."""
import json
import types
import typing
from typing import Any


def read_toml(path: str) -> dict[str, Any]:
    """The tables of the TOML file `path`; one-line errors naming --config PATH."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: its backport, the same API (a dependency there)
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: not TOML ({e})") from None


def toml_value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(toml_value, value)) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):  # repr reads back exactly; TOML spells them inf and nan too
        return repr(value)
    if isinstance(value, str):  # a TOML basic string is a JSON string, but for DEL, which TOML escapes
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    return str(value)


def typed(value: Any, kind: Any, where: str) -> Any:
    """`value` read from TOML, checked against the field's type (an int where a float goes becomes a float)."""
    options = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    for option in options:
        if typing.get_origin(option) is list:  # a list of strings (--data's); a string alone is a list of one
            if isinstance(value, str):
                return [value]
            if isinstance(value, list) and value and all(isinstance(v, str | int | float) and not isinstance(v, bool)
                                                         for v in value):
                return [str(v) for v in value]
        if option is bool and isinstance(value, bool) or option is str and isinstance(value, str):
            return value
        if option in (int, float) and isinstance(value, int | float) and not isinstance(value, bool) \
                and (option is float or isinstance(value, int)):
            return option(value)
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
             list[str]: "a string or a list of strings and numbers"}
    wanted = " or ".join(names[o] for o in options if o in names)
    raise ValueError(f"{where} = {value!r} must be {wanted}")
