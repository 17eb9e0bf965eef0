"""Pipeline parameters: a YAML file resolved into one parameter dict per notebook, checked before anything runs.

Papermill only warns about a parameter the notebook does not declare; here an unknown or mistyped key, or a value
of the wrong type, is an error that names the key, the notebook and the fix.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path

import yaml

TOP_KEYS = {"experiment", "steps", "common", "notebooks", "output_root"}
_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "list": (list,), "dict": (dict,)}


class ParamsError(ValueError):
    """A parameter file that cannot run; the message says which key, which notebook, and the fix."""


@dataclass
class Plan:
    experiment: str
    steps: list[str]
    output_root: Path
    per_step: dict[str, dict] = field(default_factory=dict)  # step -> parameters papermill injects


def load_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ParamsError(f"parameter file {path} does not exist (see params/ for examples)") from None
    except yaml.YAMLError as e:
        raise ParamsError(f"parameter file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ParamsError(f"parameter file {path} must hold a mapping with keys {sorted(TOP_KEYS)}")
    return data


def _suggest(key: str, known) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def _type_ok(value, declared: str) -> bool:
    if value is None or declared in ("None", "", None) or declared not in _TYPES:
        return True
    if isinstance(value, bool) and declared in ("int", "float"):
        return False
    return isinstance(value, _TYPES[declared])


def parse_override(item: str) -> tuple[str | None, str, object]:
    """``--set step.key=value`` -> (step, key, value); ``--set key=value`` (common) -> (None, key, value); the value
    is parsed as YAML."""
    if "=" not in item:
        raise ParamsError(f"--set {item!r}: write KEY=VALUE or STEP.KEY=VALUE")
    key, raw = item.split("=", 1)
    step, k = key.split(".", 1) if "." in key else (None, key)
    return step, k, yaml.safe_load(raw)


def check_mappings(data: dict, source: str = "params") -> None:
    """``common``, ``notebooks`` and each ``notebooks.<step>`` are mappings (a list there, a natural slip in YAML,
    would fail deep inside with a traceback): ParamsError naming the key and the fix."""
    for key in ("common", "notebooks"):  # mappings; a list here (a natural slip in YAML) would fail deep inside
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise ParamsError(f"{source}: {key}: a {type(data[key]).__name__}, not a mapping. Fix: write it as "
                              + ("`common:` then indented `key: value` lines" if key == "common" else
                                 "`notebooks:` then `  <step>:` then indented `key: value` lines"))
    for s, section in (data.get("notebooks") or {}).items():
        if section is not None and not isinstance(section, dict):
            raise ParamsError(f"{source}: notebooks.{s}: a {type(section).__name__}, not a mapping of parameters. "
                              f"Fix: indented `key: value` lines under it")


def apply_overrides(data: dict, overrides: list[str], source: str = "params") -> dict:
    """``--set step.key=value`` / ``--set key=value`` (common), as ``parse_override`` reads them."""
    check_mappings(data, source)
    for item in overrides:
        step, k, value = parse_override(item)
        if step is not None:
            data.setdefault("notebooks", {}).setdefault(step, {})[k] = value
        else:
            data.setdefault("common", {})[k] = value
    return data


def _step_settings():
    """step -> how its notebook builds its typed settings object from its parameters (the values it was given over
    its defaults), checked whole; raises ValueError naming the setting."""
    from eagle3kit.drafter.train_config import from_notebook
    from eagle3kit.extract_config import ExtractConfig

    return {"03_extract": lambda p: ExtractConfig.from_dict({k: v for k, v in p.items() if k in ExtractConfig.names()}),
            # data and out_dir as the notebook resolves its empty ones (a folder of the run, made by then)
            "04_train": lambda p: from_notebook(p, data=p.get("data") or "embedded:sharegpt",
                                                out_dir=p.get("out_dir") or "<the step's folder>/drafter")}


def check_step_settings(step: str, params: dict, declared: dict, source: str = "params") -> None:
    """The step's own settings check (``ExtractConfig`` for 03_extract, ``TrainConfig`` for 04_train) on the
    notebook's defaults with ``params`` over them, before any step runs: a value the step would refuse stops the run
    now, not after the steps before it have run."""
    import ast

    build = _step_settings().get(step)
    if build is None:
        return
    settings = {}
    for k, d in declared.items():
        try:
            settings[k] = ast.literal_eval(str(d.get("default")))
        except (ValueError, SyntaxError):
            pass  # a default the notebook computes: the settings object's own
    try:
        build({**settings, **params})
    except ValueError as e:
        raise ParamsError(f"{source}: {step}: {e}") from None


def resolve(data: dict, declared: dict[str, dict], only: list[str] | None = None, source: str = "params",
            cli_common=()) -> Plan:
    """Check ``data`` against each notebook's declared parameters (papermill.inspect_notebook) and resolve.

    ``declared`` maps step name -> {param name: {"inferred_type_name": ..., "default": ...}}. ``cli_common``: the
    common keys given on the command line (``--set key=value``), which must reach a step run now.
    """
    check_mappings(data, source)
    unknown_top = set(data) - TOP_KEYS
    if unknown_top:
        k = sorted(unknown_top)[0]
        raise ParamsError(f"{source}: unknown top-level key {k!r}; allowed: {sorted(TOP_KEYS)}.{_suggest(k, TOP_KEYS)}")
    steps = list(data.get("steps") or declared)
    for s in steps:
        if s not in declared:
            raise ParamsError(f"{source}: step {s!r} has no notebook notebooks/{s}.ipynb.{_suggest(s, declared)}")
    planned = steps  # a common key needs a notebook among all of them, not only those --only runs now
    if only:
        for s in only:
            if s not in steps:
                raise ParamsError(f"--only {s}: not a step of {source} (steps: {steps}).{_suggest(s, steps)}")
        steps = [s for s in steps if s in only]
    common = data.get("common") or {}
    sections = data.get("notebooks") or {}
    for s in sections:
        if s not in declared:
            raise ParamsError(f"{source}: notebooks.{s}: no such notebook.{_suggest(s, declared)}")
    for k in common:
        if not any(k in declared[s] for s in planned):
            known = {p for s in planned for p in declared[s]}
            raise ParamsError(f"{source}: common.{k}: no notebook of this run declares {k!r}.{_suggest(k, known)}")
        if k in cli_common and not any(k in declared[s] for s in steps):
            raise ParamsError(f"--set {k}=...: no step run now ({', '.join(steps)}) declares {k!r}; it would change "
                              f"nothing (write STEP.{k}=... for a step of {source}, or run that step)")
    checked = {}
    for s in set(steps) | set(sections):  # sections of steps not run now are checked too
        params = {k: v for k, v in common.items() if k in declared[s]}
        for k, v in (sections.get(s) or {}).items():
            if k not in declared[s]:
                raise ParamsError(
                    f"{source}: notebooks.{s}.{k}: notebook {s} declares no parameter {k!r}.{_suggest(k, declared[s])}"
                    f" Its parameters: {sorted(declared[s])}")
            params[k] = v
        for k, v in params.items():
            want = declared[s][k].get("inferred_type_name")
            if not _type_ok(v, want):
                raise ParamsError(f"{source}: {s}.{k} = {v!r} is a {type(v).__name__}, but notebook {s} declares"
                                  f" {k} as {want} (default {declared[s][k].get('default')})")
        checked[s] = params
    for s in checked:
        check_step_settings(s, checked[s], declared[s], source)
    per_step = {s: checked[s] for s in steps}
    return Plan(experiment=str(data.get("experiment") or "default"), steps=steps,
                output_root=Path(data.get("output_root") or "outputs"), per_step=per_step)
