"""Make the vendored workload data: ``python vllm_specplug/data/workloads/generate.py``.

Writes, beside this file (deterministic: fixed seeds, sorted inputs):

* ``pipeline.jsonl``: an offline batch pipeline, 160 requests of ONE task
  template (extract six fields as JSON) over free-text personnel records
  generated from the word lists below. Apache-2.0 (this project).
* ``agentic.jsonl``: a coding-agent loop, 32 sessions of 4-6 turns over small
  top-level functions of CPython's standard library (PSF License 2,
  ``LICENSE.cpython``; read from the running Python's ``Lib/``, which for the
  vendored file was CPython 3.11.7). Each turn is a user message of the
  conversation; the bench sends it with the earlier turns and the model's own
  earlier outputs (``bench.workloads.build_messages``).

Rows: ``{"id", "category", "prompt"}`` (pipeline) and ``{"id", "session",
"turn", "category", "system", "prompt"}`` (agentic).
"""
from __future__ import annotations

import ast
import json
import random
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent

# ------------------------------------------------------------------ pipeline
PIPELINE_SEED = 20
PIPELINE_SIZE = 160
PIPELINE_TEMPLATE = (
    "Extract the fields name, date_of_birth, city, email, employer, job_title as JSON from "
    "this record. Write date_of_birth as YYYY-MM-DD and use null for a field the record does "
    "not give. Output only the JSON object.\n\nRecord:\n{record}")

FIRST = ("Maria", "James", "Aisha", "Kenji", "Olga", "Tomasz", "Priya", "Lucas", "Fatima",
         "Daniel", "Ingrid", "Mateo", "Chloe", "Emeka", "Hannah", "Ravi", "Sofia", "Liam",
         "Yuki", "Noah", "Elena", "Omar", "Grace", "Henrik", "Leila", "Carlos", "Mei",
         "Patrick", "Zara", "Viktor", "Amara", "Samuel", "Nadia", "Jonas", "Ines", "Kwame",
         "Alice", "Dmitri", "Rosa", "Tariq")
LAST = ("Okafor", "Smith", "Tanaka", "Kowalski", "Sharma", "Silva", "Haddad", "Novak",
        "Johansson", "Garcia", "Chen", "Murphy", "Mensah", "Petrov", "Rossi", "Khan",
        "Dubois", "Schneider", "Nakamura", "Oliveira", "Fischer", "Adeyemi", "Larsen",
        "Moreau", "Ivanova", "Costa", "Brennan", "Yilmaz", "Lindqvist", "Abara")
CITIES = ("Leeds", "Porto", "Osaka", "Krakow", "Pune", "Lyon", "Accra", "Malmo", "Denver",
          "Valencia", "Graz", "Tampere", "Cork", "Izmir", "Rotterdam", "Brno", "Quito",
          "Adelaide", "Halifax", "Nagoya", "Bergen", "Tucson", "Bologna", "Gdansk",
          "Mombasa", "Lille", "Leipzig", "Cebu", "Aarhus", "Cusco")
EMPLOYERS = ("Northwind Logistics", "Brightfield Energy", "Cobalt Health", "Juniper Foods",
             "Redwood Analytics", "Harbor Insurance", "Silverline Rail", "Apex Robotics",
             "Meadow Pharmaceuticals", "Bluepeak Software", "Granite Construction Group",
             "Lumen Media", "Evergreen Bank", "Orchid Textiles", "Summit Telecom",
             "Keystone Legal", "Atlas Shipping", "Pinecrest Schools", "Nova Aerospace",
             "Riverside Hospital")
TITLES = ("data analyst", "nurse", "software engineer", "accountant", "project manager",
          "warehouse supervisor", "graphic designer", "sales representative",
          "mechanical engineer", "teacher", "paralegal", "marketing coordinator",
          "pharmacist", "HR specialist", "network administrator", "site manager",
          "research scientist", "customer support lead", "financial advisor", "pilot")
DOMAINS = ("mail.com", "example.org", "inbox.net", "post.eu", "webmail.io")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December")
NOTES = ("Prefers contact by email.", "Badge renewed last spring.",
         "Requested a standing desk.", "Completed the safety course.",
         "Works remotely on Fridays.", "Speaks three languages.",
         "On the volunteer first-aid rota.", "Transferred from the regional office.",
         "Has a parking permit for level 2.", "Mentors two junior colleagues.")


def _date_text(rng: random.Random, y: int, m: int, d: int) -> str:
    style = rng.randrange(4)
    if style == 0:
        return f"{d} {MONTHS[m - 1]} {y}"
    if style == 1:
        return f"{MONTHS[m - 1]} {d}, {y}"
    if style == 2:
        return f"{y}-{m:02d}-{d:02d}"
    return f"{d} {MONTHS[m - 1][:3]} {y}"


def _record(rng: random.Random, i: int) -> str:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    y, m, d = rng.randint(1952, 2003), rng.randint(1, 12), rng.randint(1, 28)
    dob = _date_text(rng, y, m, d)
    city, employer, title = rng.choice(CITIES), rng.choice(EMPLOYERS), rng.choice(TITLES)
    email = (f"{first.lower()}.{last.lower()}@{rng.choice(DOMAINS)}"
             if rng.random() > 0.15 else None)
    phone = f"+{rng.randint(30, 49)} {rng.randint(100, 999)} {rng.randint(1000, 9999)}"
    note, ref = rng.choice(NOTES), f"{rng.choice('ABCDEFGH')}-{rng.randint(1000, 9999)}"
    contact = f"Email: {email}." if email else "No email address on file."
    style = i % 5
    if style == 0:
        return (f"{first} {last} (born {dob}) works as a {title} at {employer} in {city}. "
                f"{contact} Phone {phone}. {note}")
    if style == 1:
        lines = [f"REF: {ref}", f"NAME: {last.upper()}, {first}", f"DOB: {dob}",
                 f"LOCATION: {city}", f"ROLE: {title} ({employer})"]
        if email:
            lines.append(f"EMAIL: {email}")
        return "\n".join(lines + [f"PHONE: {phone}", f"NOTES: {note}"])
    if style == 2:
        return (f"Hi team, please welcome {first} {last}, who joins {employer} as our new "
                f"{title} at the {city} site next week. {first} was born on {dob}. "
                + (f"You can reach {first} at {email} or on {phone}." if email
                   else f"{first} can be reached on {phone}.") + f" Ref {ref}.")
    if style == 3:
        return (f"Meeting note ({ref}): spoke with {first} {last} from {employer} "
                f"({title}), based in {city}. Date of birth given as {dob}. {contact} {note}")
    return ("id,full_name,birth,town,company,position,email,phone\n"
            f"{ref},{first} {last},{dob},{city},{employer},{title},{email or ''},{phone}")


def pipeline_rows() -> list[dict]:
    rng = random.Random(PIPELINE_SEED)
    return [{"id": f"pipe{i:03d}", "category": "extract_json",
             "prompt": PIPELINE_TEMPLATE.format(record=_record(rng, i))}
            for i in range(PIPELINE_SIZE)]


# ------------------------------------------------------------------- agentic
AGENTIC_SEED = 20
AGENTIC_SESSIONS = 32
MODULES = ("textwrap", "shlex", "fnmatch", "posixpath", "colorsys", "calendar", "statistics",
           "heapq", "bisect", "html/__init__", "base64", "glob", "difflib", "gettext",
           "ipaddress", "quopri", "mimetypes", "tokenize", "locale", "platform", "pprint",
           "urllib/parse", "email/utils", "shutil", "filecmp", "tempfile")
MIN_LINES, MAX_LINES, MAX_CHARS = 8, 28, 1100

SYSTEM = (
    "You are a coding agent working in a checkout of the CPython repository. You act only "
    "through tools: read_file(path, start, end) returns lines of a file, write_file(path, "
    "content) replaces a function, run_tests(module) runs the module's tests. Tool results "
    "arrive in user messages that start with 'Tool result'. When you are asked for code, "
    "output the complete function in one ```python block, unchanged except for the requested "
    "edit, and nothing after the block. When asked for a diff, output a unified diff in one "
    "```diff block.")

TASKS = (
    "add type hints to the signature of `{name}`",
    "add a docstring to `{name}` that describes its arguments and return value",
    "rename the local variables of `{name}` to longer, descriptive names",
    "make `{name}` raise TypeError with a clear message when its first argument is None",
    "add a comment above each branch of `{name}` that says what the branch handles",
    "rewrite `{name}` so that every return statement is preceded by a blank line",
)
ERRORS = (
    "NameError: name 'Optional' is not defined",
    "AssertionError: {name}() returned a different value for the doctest example",
    "SyntaxError: unexpected indent (line {line})",
    "TypeError: {name}() takes {n} positional arguments but {m} were given",
    "flake8: E501 line too long (104 > 79 characters) at line {line}",
    "UnboundLocalError: cannot access local variable 'result' where it is not associated "
    "with a value",
)
EXTRA_TURNS = (
    ("final", "Tests pass. Output the final version of `{name}` again, with a one-line "
              "comment above the def that says what was changed."),
    ("final", "Before committing, output the complete function once more exactly as it will "
              "be written by write_file(\"{path}\", ...), followed by a one-line commit "
              "message."),
)


def _functions(lib: Path) -> list[tuple[str, str, int, str]]:
    """(module path, function name, first line, source) of the small,
    undecorated top-level functions of MODULES."""
    out = []
    for mod in MODULES:
        path = lib / f"{mod}.py"
        src = path.read_text()
        lines = src.splitlines()
        for node in ast.parse(src).body:
            if (not isinstance(node, ast.FunctionDef) or node.decorator_list
                    or node.name.startswith("__")):
                continue
            n = node.end_lineno - node.lineno + 1
            text = "\n".join(lines[node.lineno - 1:node.end_lineno])
            if MIN_LINES <= n <= MAX_LINES and len(text) <= MAX_CHARS:
                out.append((f"Lib/{mod}.py", node.name, node.lineno, text))
    return out


def _session(rng: random.Random, k: int, path: str, name: str, line: int,
             src: str) -> list[dict]:
    n_lines = src.count("\n") + 1
    task = rng.choice(TASKS).format(name=name)
    error = rng.choice(ERRORS).format(name=name, line=line + rng.randrange(n_lines),
                                      n=rng.randint(1, 3), m=rng.randint(4, 5))
    sid = f"agent{k:02d}"
    read = f"read_file(\"{path}\", {line}, {line + n_lines - 1})"
    turns = [
        ("read", f"Task: {task}.\n\nTool result {read}:\n```python\n{src}\n```\n\n"
                 f"Say in two or three sentences what you will change."),
        ("edit", "Apply the change now: output the full edited function."),
        ("fix", f"Tool result run_tests(\"{path[4:-3].replace('/', '.')}\"):\nFAILED "
                f"test_{name}\n{error}\n\nFix the problem and output the corrected full "
                f"function."),
        ("diff", f"Tool result run_tests: all tests passed. Output a unified diff of your "
                 f"final function against the original from {read}."),
    ]
    extra = rng.randint(0, len(EXTRA_TURNS))
    turns += [(cat, text.format(name=name, path=path)) for cat, text in EXTRA_TURNS[:extra]]
    return [{"id": f"{sid}:{t}", "session": sid, "turn": t, "category": cat,
             "system": SYSTEM, "prompt": text} for t, (cat, text) in enumerate(turns)]


def agentic_rows(lib: Path | None = None) -> list[dict]:
    lib = lib or Path(sysconfig.get_paths()["stdlib"])
    funcs = _functions(lib)
    rng = random.Random(AGENTIC_SEED)
    # at most two functions of a module, in a seeded order
    rng.shuffle(funcs)
    chosen, per_module = [], {}
    for f in funcs:
        if per_module.get(f[0], 0) < 2:
            per_module[f[0]] = per_module.get(f[0], 0) + 1
            chosen.append(f)
        if len(chosen) == AGENTIC_SESSIONS:
            break
    rows = []
    for k, f in enumerate(chosen):
        rows += _session(rng, k, *f)
    return rows


def write(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    write(HERE / "pipeline.jsonl", pipeline_rows())
    write(HERE / "agentic.jsonl", agentic_rows())
    print(f"wrote {HERE}/pipeline.jsonl and agentic.jsonl")
