"""Prompt sets for training data and evaluation, from the JSONL files in `data/` (bundled in a
wheel; `dspark_trt.resources` finds them; `$DSPARK_TRT_DATA` names another folder).

Named sets (see `data/SOURCES.md` for origins and licenses):

| name          | file                               | domain | use        |
| ------------- | ---------------------------------- | ------ | ---------- |
| gsm8k-train   | gsm8k/train.jsonl                  | math   | training   |
| t0            | t0_prompts/prompts.jsonl           | chat   | training   |
| self-instruct | self_instruct/seed_tasks.jsonl     | chat   | training   |
| code-stdlib   | built from Python stdlib docstrings| code   | training   |
| code-stdlib-complete | the same functions as stubs to complete | code | training |
| code-stdlib-extra | the rest of the stdlib: functions of every other module, methods of every class | code | training |
| code-stdlib-extra-complete | the same as stubs to complete | code | training |
| mt-bench      | mt_bench/question.jsonl (turn 1)   | chat   | evaluation |
| humaneval     | humaneval/HumanEval.jsonl.gz       | code   | evaluation |
| gsm8k         | gsm8k/test.jsonl                   | math   | evaluation |

Second turns (`follow_up_prompts`, `dspark-trt datagen --follow-up DATA`) are built from a datagen
file instead: a training chat row's own conversation, the target's answer to it, then one of
`FOLLOW_UPS` (generic requests written for this project, none taken from an evaluation set).
Resamples (`resample_prompts`, `dspark-trt datagen --resample DATA`) ask a datagen file's training
prompts again at the other temperature, for a second, different response to each.

Any other value is read as a JSONL path whose rows hold one of the fields `prompt`,
`question`, `instruction`, `turns` (first turn) or `messages`. Every prompt is returned as a
chat conversation (a list of messages), because the targets we serve are chat models; the
code set asks for a function the way a user would. Evaluation sets are never mixed into
training: `TRAINING_SETS` and `EVALUATION_SETS` are disjoint by construction. Ids are positions
(`<set>/<row>`); for the code sets, positions in this Python's stdlib listing, which another
Python version may order differently: a data file stays valid (rows keep their token ids), but
do not resume one made under another Python version by id.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import gzip
import hashlib
import importlib
import inspect
import io
import json
import os
import re
import sys
import warnings
from pathlib import Path

from dspark_trt import resources
from dspark_trt.errors import DsparkError

DATA_OVERRIDE = os.environ.get("DSPARK_TRT_DATA")  # another folder laid out like data/
DATA_DIR = Path(DATA_OVERRIDE) if DATA_OVERRIDE else resources.locate("prompts")

TRAINING_SETS = {
    "gsm8k-train": ("gsm8k/train.jsonl", "math"),
    "t0": ("t0_prompts/prompts.jsonl", "chat"),
    "self-instruct": ("self_instruct/seed_tasks.jsonl", "chat"),
    "code-stdlib": (None, "code"),
    "code-stdlib-complete": (None, "code"),
    "code-stdlib-extra": (None, "code"),
    "code-stdlib-extra-complete": (None, "code"),
}
EVALUATION_SETS = {
    "mt-bench": ("mt_bench/question.jsonl", "chat"),
    "humaneval": ("humaneval/HumanEval.jsonl.gz", "code"),
    "gsm8k": ("gsm8k/test.jsonl", "math"),
}

# Modules whose public functions have good one-line docstrings to turn into coding tasks.
STDLIB_MODULES = (
    "os", "os.path", "shutil", "string", "textwrap", "json", "re", "math", "statistics", "itertools",
    "functools", "collections", "heapq", "bisect", "random", "datetime", "calendar", "fractions",
    "difflib", "csv", "base64", "binascii", "hashlib", "urllib.parse", "html", "fnmatch", "glob",
    "copy", "pprint", "operator", "struct", "zlib", "gzip", "ipaddress", "colorsys", "shlex",
    "keyword", "secrets", "email.utils", "posixpath", "queue", "cmath", "time", "locale", "codecs",
    "typing", "dataclasses", "contextlib", "io", "tempfile", "filecmp", "zipfile", "tarfile",
    "argparse", "logging", "warnings", "traceback", "inspect", "quopri", "mimetypes", "wave",
)


@dataclasses.dataclass
class Prompt:
    prompt_id: str  # "<set>/<row>"
    domain: str  # chat | math | code
    messages: list[dict]  # the conversation to answer
    temperature: float | None = None  # fixed for this prompt (a resample); None: datagen's cycle decides
    prompt_ids: list[int] | None = None  # the encoded prompt, when it must be exactly a datagen row's (a resample)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text.strip()}]


def row_to_messages(row: dict) -> list[dict] | None:
    """The conversation a JSONL row asks for, from whichever prompt field it has."""
    if "messages" in row:
        return row["messages"]
    if "turns" in row:
        return user(row["turns"][0])
    if "instruction" in row:  # self-instruct: instruction plus the first instance's input
        instance = (row.get("instances") or [{}])[0].get("input", "")
        return user(row["instruction"] + ("\n\n" + instance if instance else ""))
    if "question" in row:
        return user(row["question"])
    if "prompt" in row:
        return user(row["prompt"])
    return None


def read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        raise DsparkError(f"prompt file {path} not found") from None
    except (json.JSONDecodeError, OSError) as exc:
        raise DsparkError(f"{path} is not valid JSONL: {exc}") from None


def humaneval_messages(row: dict) -> list[dict]:
    return user("Complete the following Python function.\n\n```python\n" + row["prompt"] + "```")


def documented(obj) -> tuple[str, str] | None:
    """(signature, docstring summary) of a function worth a coding task, or None: it needs a
    summary (the docstring's first paragraph) of at least 20 characters and a signature `inspect`
    can give. Callers filter signatures further where a stub must be runnable Python."""
    doc = inspect.getdoc(obj)
    summary = doc.split("\n\n")[0].replace("\n", " ").strip() if doc else ""
    if len(summary) < 20:
        return None
    try:
        signature = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None
    return signature, summary


def public_functions(module) -> list[tuple[str, str, str]]:
    """(name, signature, summary) of a module's own documented public functions, by name."""
    functions = []
    for name, obj in sorted(vars(module).items()):
        if not name.startswith("_") and inspect.isfunction(obj) and obj.__module__ == module.__name__:
            if found := documented(obj):
                functions.append((name, *found))
    return functions


def stdlib_functions() -> list[tuple[str, str, str]]:
    """(name, signature, docstring summary) of the public stdlib functions worth a coding task."""
    functions = []
    for module_name in STDLIB_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        functions.extend(public_functions(module))
    return functions


# Importing these does something (opens a browser or a window, prints the Zen of Python) or they
# are tests and packaging tools rather than library code.
STDLIB_SKIPPED = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "ensurepip", "venv",
                            "lib2to3", "pydoc_data", "test", "xxlimited", "xxsubtype", "msvcrt", "winreg",
                            "winsound", "nt"})


def stdlib_extra_functions() -> list[tuple[str, str, str]]:
    """The rest of the stdlib, as (qualified name, signature, summary): the functions of every
    importable top-level module not in `STDLIB_MODULES`, then the methods of every public class
    of every module (`Class.method`, `self` in the signature). Modules are imported with warnings
    and printing silenced; their order is this Python's `sys.stdlib_module_names`, sorted. A task
    that another module or `stdlib_functions` already gives (ntpath and posixpath share docstrings)
    is kept once; one whose signature is not Python (`parses_as_python`) is left out."""
    functions, methods = [], []
    for module_name in sorted(sys.stdlib_module_names):
        if module_name.startswith("_") or module_name in STDLIB_SKIPPED:
            continue
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("ignore")
                module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001  (a platform's missing module fails in many ways)
            continue
        if module_name not in STDLIB_MODULES:
            functions.extend(public_functions(module))
        for class_name, cls in sorted(vars(module).items()):
            if class_name.startswith("_") or not inspect.isclass(cls) or cls.__module__ != module.__name__:
                continue
            for name, obj in sorted(vars(cls).items()):
                # a method another package patched onto a stdlib class (transformers adds
                # `Logger.warning_advice` on import) is not the stdlib's, and would make the set
                # depend on what the process imported first
                if (not name.startswith("_") and inspect.isfunction(obj) and obj.__module__ == module.__name__
                        and (found := documented(obj))):
                    methods.append((f"{class_name}.{name}", *found))
    seen = set(stdlib_functions())
    unique = []
    for task in functions + methods:
        if task not in seen and parses_as_python(task[1]):
            seen.add(task)
            unique.append(task)
    return unique


def parses_as_python(signature: str) -> bool:
    """Whether `def f<signature>: ...` is Python: defaults that print as `<Enum.X: 1>` or
    `<object at 0x...>` are not, and would make a stub no one could run (or one that changes
    from run to run)."""
    try:
        ast.parse(f"def f{signature}: ...")
    except SyntaxError:
        return False
    return True


def write_a_function(name: str, signature: str, summary: str) -> list[dict]:
    what = f"the method `{name}{signature}` of a Python class" if "." in name else f"a Python function `{name}{signature}`"
    return user(f"Write {what}. {summary} Include a docstring and a short usage example.")


def complete_a_function(name: str, signature: str, summary: str) -> list[dict]:
    if "." in name:  # a method: the stub is its class with the one method
        class_name, method = name.split(".", 1)
        stub = f'class {class_name}:\n    def {method}{signature}:\n        """{summary}"""\n'
    else:
        stub = f'def {name}{signature}:\n    """{summary}"""\n'
    return user("Complete the following Python function.\n\n```python\n" + stub + "```")


def stdlib_code_prompts() -> list[list[dict]]:
    """"Write a Python function `name(signature)` that <docstring summary>" for stdlib functions."""
    return [write_a_function(*function) for function in stdlib_functions()]


def stdlib_completion_prompts() -> list[list[dict]]:
    """The same functions as a stub to complete: a signature and docstring, the way code-completion
    prompts are written (content from the stdlib, never from an evaluation set). Signatures whose
    defaults print as memory addresses are skipped: their text would change from run to run."""
    return [complete_a_function(*function) for function in stdlib_functions() if " at 0x" not in function[1]]


BUILT_CODE_SETS = {  # name -> its prompts, built from this Python's stdlib
    "code-stdlib": stdlib_code_prompts,
    "code-stdlib-complete": stdlib_completion_prompts,
    "code-stdlib-extra": lambda: [write_a_function(*f) for f in stdlib_extra_functions()],
    "code-stdlib-extra-complete": lambda: [complete_a_function(*f) for f in stdlib_extra_functions()],
}


# Generic second turns, asked in turn of the rows (written here, not taken from MT-Bench, whose
# second turns are specific to each question).
FOLLOW_UPS = (
    "Can you explain that in more detail?",
    "Summarize your answer in one sentence.",
    "Give me a concrete example.",
    "Rewrite your answer so that a ten-year-old could understand it.",
    "List the main points of your answer as bullet points.",
    "Make your answer shorter.",
    "Why? Explain your reasoning step by step.",
    "Rewrite your answer in a more formal tone.",
    "Suggest a good title for your answer.",
    "What did you leave out? Add anything important.",
    "Are you sure? Check your answer and correct any mistakes.",
    "Now answer the same question for a different audience: experts in the field.",
)


# a default shown as `<function copy2 at 0x7f4d31ee2160>`: its address changes from process to process
MEMORY_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


class FirstTurns:
    """The training-set conversation behind a datagen row, checked against the row's own
    `prompt_ids` (same set, same tokenizer), so rows from another target or set version are
    refused by id rather than rebuilt wrongly. The one difference allowed is a memory address
    (`<function copy2 at 0x7f...>`: a few stdlib signatures print a default that way, and it
    changes from process to process). Sets are loaded once, on first use."""

    def __init__(self, tokenizer, purpose: str):
        self.tokenizer, self.purpose = tokenizer, purpose
        self.sets: dict[str, list[Prompt]] = {}

    def __call__(self, row: dict) -> list[dict]:
        from dspark_trt.runtime.chat import encode_chat

        set_name, _, index = row["id"].rpartition("/")
        if set_name not in TRAINING_SETS or not index.isdigit():
            raise DsparkError(f"{self.purpose}: row {row['id']!r} is not from a training prompt set")
        if set_name not in self.sets:
            self.sets[set_name] = load_prompts(set_name)
        messages = self.sets[set_name][int(index)].messages
        ids = encode_chat(self.tokenizer, messages)
        if ids != row["prompt_ids"] and not self.same_but_addresses(ids, row["prompt_ids"]):
            raise DsparkError(f"{self.purpose}: row {row['id']!r}: its prompt_ids are not {set_name}'s prompt {index} "
                              "under this tokenizer (another target or another version of the set?)")
        return messages

    def same_but_addresses(self, ids: list[int], other: list[int]) -> bool:
        texts = [MEMORY_ADDRESS.sub(" at 0x", self.tokenizer.decode(x)) for x in (ids, other)]
        return texts[0] == texts[1]


def follow_up_prompts(rows: list[dict], tokenizer, per_row: int = 1) -> list[Prompt]:
    """Second turns after the target's own chat answers: for every training row (never a held-out
    one: its prompt must not reach training in any turn) of domain chat that ended by EOS (a cut
    answer is no place for a follow-up), the row's conversation, the answer, and `per_row` of
    `FOLLOW_UPS` in turn, one prompt each. Ids are `followup/<row id>/<r>`. The row's prompt must
    re-encode to its own `prompt_ids` (same set, same tokenizer), or the row is refused by id."""

    first_turn = FirstTurns(tokenizer, "follow-up")
    prompts = []
    for row in rows:
        if row.get("domain") != "chat" or row.get("finish_reason") != "stop" or is_held_out(row["id"]):
            continue
        first = first_turn(row)
        answer = tokenizer.decode(row["response_ids"], skip_special_tokens=True).strip()
        row_number = len(prompts) // per_row
        for turn in range(per_row):  # datagen cycles temperatures 0, 1 by place in this set: each question meets both
            question = FOLLOW_UPS[(row_number // 2 + turn * 7) % len(FOLLOW_UPS)]
            conversation = [*first, {"role": "assistant", "content": answer}, *user(question)]
            prompts.append(Prompt(f"followup/{row['id']}/{turn}", "chat", conversation))
    return prompts


RESAMPLE_PREFIX = "resample/"

def is_held_out(row_id: str, fraction: float = 0.05) -> bool:
    """A stable split by id: the same rows are held out (for calibration/validation) on every run.
    A resample (`resample/<id>`: the same prompt answered again) goes where its first row went,
    so a held-out prompt never reaches training through its second response."""
    row_id = row_id.removeprefix(RESAMPLE_PREFIX)
    return int(hashlib.sha256(row_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < fraction



def resample_prompts(rows: list[dict], tokenizer) -> list[Prompt]:
    """A second, different response to every training row's prompt: its conversation again at the
    other temperature of datagen's pair (a row answered greedily is sampled at 1; a sampled one
    is answered greedily: a second greedy answer would repeat the first token for token). Ids are
    `resample/<row id>`; held-out rows are skipped (`is_held_out` splits a resample by the
    row it came from, so none could reach training anyway). Only rows of the named training sets
    can be resampled (their conversation is rebuilt and checked against `prompt_ids`); the prompt
    asked is the row's own `prompt_ids`, token for token."""

    first_turn = FirstTurns(tokenizer, "resample")
    return [Prompt(RESAMPLE_PREFIX + row["id"], row["domain"], first_turn(row),
                   temperature=1.0 if row["temperature"] == 0 else 0.0, prompt_ids=row["prompt_ids"])
            for row in rows if not is_held_out(row["id"])]


def cycle_temperatures(prompts: list[Prompt], temperatures: tuple[float, ...]) -> list[Prompt]:
    """Each prompt of one set that has no temperature of its own gets `temperatures[i % n]` by its
    place i in that set, so every set meets each temperature as often however the sets are
    interleaved. (Cycling over the interleaved list instead gave the bf16 set's T0 prompts 2,918
    sampled answers and 314 greedy ones: once the small sets ran out, GSM8K and T0 alternated.)"""
    return [p if p.temperature is not None else dataclasses.replace(p, temperature=temperatures[i % len(temperatures)])
            for i, p in enumerate(prompts)]


def load_prompts(name: str, limit: int | None = None) -> list[Prompt]:
    """The first `limit` prompts of a named set or JSONL file (all when limit is None)."""
    if name in BUILT_CODE_SETS:
        conversations, domain = BUILT_CODE_SETS[name](), "code"
    elif name in TRAINING_SETS or name in EVALUATION_SETS:
        relative, domain = {**TRAINING_SETS, **EVALUATION_SETS}[name]
        if not DATA_DIR.is_dir():
            if DATA_OVERRIDE:
                raise DsparkError(f"prompt set {name!r}: $DSPARK_TRT_DATA={DATA_DIR} is not a folder")
            raise DsparkError(f"prompt set {name!r}: {resources.missing_message('prompts', DATA_DIR)}")
        rows = read_jsonl(DATA_DIR / relative)
        convert = humaneval_messages if name == "humaneval" else row_to_messages
        conversations = [convert(row) for row in rows]
    else:
        path = Path(name)
        if not path.is_file():
            known = ", ".join([*TRAINING_SETS, *EVALUATION_SETS])
            raise DsparkError(f"unknown prompt set {name!r}: give one of {known} or a JSONL file")
        conversations, domain = [row_to_messages(row) for row in read_jsonl(path)], "custom"
        if any(c is None for c in conversations):
            raise DsparkError(f"{path}: every row needs one of the fields prompt, question, instruction, turns, messages")
        name = path.stem
    prompts = [Prompt(f"{name}/{i}", domain, c) for i, c in enumerate(conversations)]
    return prompts[:limit] if limit is not None else prompts
