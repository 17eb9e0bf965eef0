"""Does a setting's value, as YAML, JSON or argparse gave it, fit its dataclass field? Shared by the typed settings
objects (``TrainConfig``, ``ExtractConfig``)."""


def fits(value, annotation) -> bool:
    """``value`` against a field annotated ``annotation`` (a string under ``from __future__ import annotations``):
    ints fit floats, a bool fits only bool, ``list[int]`` wants ints inside."""
    kinds = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "list": (list,),
             "list[int]": (list,), "dict": (dict,)}
    for part in str(annotation).split("|"):
        part = part.strip()
        if part == "None" and value is None:
            return True
        ok = kinds.get(part)
        if ok and isinstance(value, ok) and (part == "bool" or not isinstance(value, bool)) and \
                (part != "list[int]" or all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
            return True
    return False


def setting(default, help: str, **meta):
    """A settings object's field with its help (docs and command line) and any other metadata (``flag``, ``choices``,
    ``nargs``, ...). A list default is copied for each object."""
    from dataclasses import field

    meta = {"help": help, **meta}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def default_of(f):
    """A dataclass field's default (its factory's value for a list)."""
    from dataclasses import MISSING

    if f.default_factory is not MISSING:
        return f.default_factory()
    return f.default


def markdown_table(cls, command: str, flag) -> str:
    """docs/settings.md's table of a settings object, made from its fields: name, ``flag(field)`` (how ``command``
    sets it; None: Python and notebook only), default, help."""
    from dataclasses import MISSING, fields

    rows = [f"| setting | `{command}` | default | what it sets |", "|---|---|---|---|"]
    for f in fields(cls):
        how = flag(f)
        has_default = f.default is not MISSING or f.default_factory is not MISSING
        default = f"`{default_of(f)!r}`" if has_default else "(required)"
        rows.append(f"| `{f.name}` | {f'`{how}`' if how else '(Python and notebook only)'} | {default} | "
                    f"{f.metadata['help'].replace('|', '/')} |")
    return "\n".join(rows) + "\n"
