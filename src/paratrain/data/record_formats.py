"""Rows of other tools' record formats turned into paratrain's own before encoding (data.records,
decided by config/formats.py): ShareGPT conversations into `messages`, Alpaca's instruction and
input into `input`, TRL's conversational prompt/completion into one `messages` conversation.
`native` rows pass through untouched."""

from __future__ import annotations

from typing import Any, Dict, List

from ..errors import DataError

Row = Dict[str, Any]
# ShareGPT's speakers -> chat roles (the names LLaMA-Factory and axolotl map as well)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
                  "system": "system"}


def to_native(rows: List[Row], records: str, what: str) -> List[Row]:
    """`rows` in paratrain's fields (see the module docstring); `what` names the source."""
    if records == "native":
        return rows
    convert = {"sharegpt": _sharegpt, "alpaca": _alpaca,
               "prompt_completion": _prompt_completion}[records]
    return [convert(row, f"{what}: row {i}") for i, row in enumerate(rows, start=1)]


def _sharegpt(row: Row, where: str) -> Row:
    turns = row.get("conversations")
    if not isinstance(turns, list):
        raise DataError(f"{where}: 'conversations' is a {type(turns).__name__}, not a list of "
                        "{from, value} turns (data.records=sharegpt)")
    messages = []
    for turn in turns:
        speaker = turn.get("from") if isinstance(turn, dict) else None
        if speaker not in SHAREGPT_ROLES or not isinstance(turn.get("value"), str):
            raise DataError(f"{where}: a ShareGPT turn needs 'from' (one of "
                            f"{', '.join(SHAREGPT_ROLES)}) and a text 'value'; got "
                            f"{str(turn)[:80]}")
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": turn["value"]})
    if isinstance(row.get("system"), str) and row["system"] and \
            (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": row["system"]})
    return {"messages": messages}


def _alpaca(row: Row, where: str) -> Row:
    instruction, extra, output = row.get("instruction"), row.get("input") or "", row.get("output")
    if not (isinstance(instruction, str) and isinstance(extra, str) and isinstance(output, str)):
        raise DataError(f"{where}: an Alpaca record needs text 'instruction' and 'output' (and "
                        "an optional text 'input')")
    return {"input": f"{instruction}\n\n{extra}" if extra else instruction, "output": output}


def _prompt_completion(row: Row, where: str) -> Row:
    prompt, completion = row.get("prompt"), row.get("completion")
    prompt = [prompt] if isinstance(prompt, dict) else prompt
    completion = [completion] if isinstance(completion, dict) else completion
    if not (isinstance(prompt, list) and isinstance(completion, list)):
        raise DataError(f"{where}: conversational prompt/completion records hold lists of "
                        "{role, content} messages in both fields")
    return {"messages": prompt + completion}
