"""`python -m models.train`'s flags, built from the job config's fields (config/fields.py `option`): each field's flag,
type, default, choices, metavar and help come from its dataclass field, Megatron-LM's names as aliases of the same
field; --help groups them by config section. The parser refuses a bad command line in one line (exit 2): an unknown
flag with the closest known ones, not the usage."""
import argparse
import dataclasses
import difflib
import inspect
import types
import typing
from typing import Any

from .config import JobConfig
from .config.fields import dest, flag_of

UNSET = object()  # (the value of a flag the command line did not give, while `given_flags` is worked out)


class Parser(argparse.ArgumentParser):
    """Records the flags the command line gave (`given_flags`, argparse dests): with --config, those alone win over
    the file, not the defaults of the others. Every error is one line, without the usage."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        if rest:  # (this parser knows every flag of the job: parse_args's usage dump is not for them)
            self.error(unknown_arguments(rest, self.long_flags()))
        marked, _ = super().parse_known_args(args, argparse.Namespace(**dict.fromkeys(vars(parsed), UNSET)))
        parsed.given_flags = tuple(k for k, v in vars(marked).items() if v is not UNSET)
        return parsed, rest

    def error(self, message):
        self.exit(2, f"error: {message}\n")

    def long_flags(self) -> list[str]:
        return [s for action in self._actions for s in action.option_strings if s.startswith("--")
                and action.help is not argparse.SUPPRESS]


def unknown_arguments(rest: list[str], known: list[str]) -> str:
    """The one line for arguments no flag takes: the first unknown flag and the known flags closest to it."""
    flags = [word.partition("=")[0] for word in rest if word.startswith("-")]
    if not flags:
        return f"unexpected argument {rest[0]!r} (each value follows its flag; --help lists them)"
    close = difflib.get_close_matches(flags[0], known, n=3, cutoff=0.6)
    names = f"{', '.join(close[:-1])} or {close[-1]}" if len(close) > 1 else "".join(close)
    hint = f"did you mean {names}?" if close else "python -m models.train --help lists the flags"
    return f"unknown flag {flags[0]}: {hint}"


def add_job_flags(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """One flag per field of every JobConfig section, in a help group per section; returns the groups by section."""
    groups = {}
    for name, section in JobConfig().sections().items():
        title, _, description = inspect.cleandoc(type(section).__doc__).partition(": ")
        fields = dataclasses.fields(section)
        hidden = all(f.metadata.get("hidden") for f in fields)  # ([faults]: no group shown for it)
        groups[name] = parser if hidden else parser.add_argument_group(title, description)
        for field in fields:
            add_field_flag(groups[name], field)
    return groups


def add_field_flag(group: Any, field: dataclasses.Field) -> None:
    """The flag of `field` (and its aliases), and one store_const flag per `consts` entry (--bf16)."""
    meta, name = field.metadata, dest(field)
    flags = [flag_of(name), *meta.get("aliases", ())]
    kind = value_type(field.type)
    if kind is bool:
        options = dict(action="store_true" if field.default is False else argparse.BooleanOptionalAction)
    else:
        options = dict(type=kind, metavar=meta.get("metavar"))
        if kind is list:
            options.update(type=str, nargs="+")
        if meta.get("choices") is not None:
            options["choices"] = tuple(meta["choices"])
        if meta.get("bare") is not None:
            options.update(nargs="?", const=meta["bare"])
    group.add_argument(*flags, dest=name, default=field.default, help=help_of(field), **options)
    for flag, value in meta.get("consts", {}).items():
        group.add_argument(flag, dest=name, action="store_const", const=value, default=argparse.SUPPRESS,
                           help=f"{flags[0]} {value} (Megatron's flag)")


def value_type(annotation: Any) -> type:
    """The type a flag parses for a field of this annotation: bool, int, float, list (of str) or str (a union of
    several, such as --moe-layer-freq's N or 0,1,..., is read as the string it is)."""
    options = [t for t in typing.get_args(annotation) if t is not type(None)] \
        if isinstance(annotation, types.UnionType) else [annotation]
    options = [typing.get_origin(t) or t for t in options]
    return options[0] if len(options) == 1 else str


def help_of(field: dataclasses.Field) -> str:
    """The field's help, then its default (argparse's %(default)s: the dataclass's), unless None or False."""
    if field.metadata.get("hidden"):
        return argparse.SUPPRESS
    text = field.metadata.get("help", "").replace("%", "%%")
    return text if field.default is None or field.default is False else f"{text} (default: %(default)s)"


def usage_formatter(prog: str) -> argparse.HelpFormatter:
    """--help 110 columns wide, the description's example commands kept as written."""
    return argparse.RawDescriptionHelpFormatter(prog, width=110)
