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
