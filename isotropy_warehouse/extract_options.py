"""The `extract` command's parameters and its grouped --help, both read from the one declaration of
its options (extract/declared.py).

`declared_options(func)` gives a `def extract(**options)` the signature typer reads: one typer
option per declared option, with its type, default, flag spellings and help.  `GroupedHelp` lists
the options in --help under the declaration's groups (click has no option groups: one help section
per group, the columns aligned across sections).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import List, Optional

import click
import typer
import typer.core

from extract.declared import BY_NAME, GROUPS, OPTIONS, Option

_TYPES = {"str": str, "int": int, "flag": bool, "list": List[str], "path": Path}


def typer_option(o: Option):
    """A typer option as the declaration spells it: `--x/--no-x` for a flag with an off spelling."""
    long = f"{o.flag}/{o.off}" if o.kind == "flag" and o.off else o.flag
    return typer.Option(o.default, long, *o.flags[1:], help=o.help)


def _annotation(o: Option):
    kind = _TYPES[o.kind]
    return Optional[kind] if o.default is None else kind


def declared_options(func):
    """`func(**options)` with the declared options as its signature, in declaration order."""
    func.__signature__ = inspect.Signature([
        inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=typer_option(o), annotation=_annotation(o))
        for o in OPTIONS])
    return func


def warehouse_option():
    """--warehouse as every command takes it: the declared spelling, help and default."""
    return typer_option(BY_NAME["warehouse"])


class GroupedHelp(typer.core.TyperCommand):
    """A command whose --help lists its options in the declaration's groups, then anything else
    (--help itself) under "Other options"."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records = {p.name: p.get_help_record(ctx) for p in self.get_params(ctx)}
        records = {name: r for name, r in records.items() if r is not None}
        col = min(30, max((click.formatting.term_len(term) for term, _ in records.values()), default=0))
        sections = [(title, [o.name for o in OPTIONS if o.group == key]) for key, title in GROUPS]
        sections.append(("Other options", [n for n in records if n not in BY_NAME]))
        for title, names in sections:
            rows = [records[n] for n in names if n in records]
            if rows:  # terms padded to one width, so that every section's help column starts alike
                with formatter.section(title):
                    formatter.write_dl([(term.ljust(col), text) for term, text in rows])
