#!/usr/bin/env python3
"""Run every command of README.md and of the guide pages as pasted, in order, in a fresh clone of
this commit, at digits scale, so the documentation stays true: a command that cannot be pasted, a
file a command reads before an earlier one wrote it, or an output left outside the folders
`.gitignore` covers fails the run.

The order: README.md's commands, then each page of the documentation site in the order of
mkdocs.yml's `nav`, in the same clone (a guide may read what the README or an earlier page
wrote). The benchmark pages (docs/benchmarks/) are records of measurements, each command run once
at its full scale on a named machine, and are not run; the API reference (docs/api/) has no
commands.

`knnper demo` runs at full size, and the table it prints is checked against the README's within
DEMO_TOLERANCE: its figures depend on the CPU a little, through training on torch's float32
kernels (the int8 encoder computes the same integers on every CPU: tests/test_int8_exact.py).

What is not run, and why: `pip install` and the virtual-environment steps (the environment
running this script is the install the README describes; a `pip install -e .` from the
throw-away clone would re-point it there),
`python -m pytest` (.ci/run runs the tests itself), and blocks preceded by a
`<!-- readme.py: skip (reason) -->` line. What is changed, and why, is SCALE: data-set sizes,
never a flag's meaning. Python blocks run too, with `python -c`.

    python .ci/readme.py              # run them all (15 minutes or more: it trains)
    python .ci/readme.py --list       # print the commands as they would run
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIP_MARK = re.compile(r"<!-- readme\.py: skip \((?P<why>[^)]+)\) -->")
NOT_RUN = (
    "pip install",
    "python -m pytest",
    "python3 -m venv",
    "python -m venv",
    ". .venv/bin/activate",
    "source .venv/bin/activate",
)
NOT_RUN_PAGES = ("benchmarks/", "api/")  # measurement records and the generated reference
TRAINING = re.compile(
    r"^knnper (?:--threads \d+ )?(?:train|bench table|deploy local|"
    r"experiment) "
)

# (pattern, replacement, why): digits instead of Fashion-MNIST, and few clients and rounds
SCALE: tuple[tuple[str, str | Callable[[re.Match], str], str], ...] = (
    (
        r"--dataset fashion-mnist",
        "--dataset digits",
        "digits ships with scikit-learn: no download, a second a round",
    ),
    (r" --data /usr/share/datasets/fashion-mnist", "", "digits needs no path"),
    (r" --max-train \d+", "", "digits is smaller than any --max-train in the README"),
    (
        r"--clients (\d+)",
        lambda m: f"--clients {min(int(m[1]), 10)}",
        "digits' 1,797 images make at most ten clients of a useful size",
    ),
    (r"--rounds \d+", "--rounds 2", "two rounds check the pipeline; accuracy is not the point"),
)


DEMO = "knnper demo"
# how far a printed demo figure may be from the README's: (accuracy in pp, size in kB). Measured
# differences, from training's float32 kernels (README.md lists them): FedAvg's seen clients
# 92.2% / 92.0% (one test sample)
DEMO_TOLERANCE = (0.5, 2.0)


def markdown_rows(text: str, header: str) -> dict[tuple[str, str], dict[str, str]]:
    """The rows of the first markdown table in `text` whose header line starts with `header`,
    by (method, where)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    columns = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        row = dict(zip(columns, (c.strip() for c in line.strip("|").split("|")), strict=True))
        rows[row["method"], row["where"]] = row
    return rows


def _number(cell: str) -> float | None:
    return None if cell == "-" else float(cell.removesuffix(" kB"))


def demo_differences(readme_text: str, printed: str) -> list[str]:
    """Where the demo's printed table is outside DEMO_TOLERANCE of the README's."""
    header = "| method | where |"
    want, got = markdown_rows(readme_text, header), markdown_rows(printed, header)
    if set(want) != set(got):
        return [f"rows differ: README {sorted(want)}, printed {sorted(got)}"]
    problems = []
    for key, row in want.items():
        pp, kb = DEMO_TOLERANCE
        for column, expected in row.items():
            if column in ("method", "where"):
                continue
            a, b = _number(expected), _number(got[key][column])
            bound = kb if expected.endswith("kB") else pp
            if (a is None) != (b is None) or (a is not None and abs(a - b) > bound + 1e-9):
                problems.append(
                    f"{' / '.join(key)}, {column}: README {expected}, printed "
                    f"{got[key][column]} (tolerance {bound:g})"
                )
    return problems


@dataclass
class Command:
    source: str  # the file it is in, from the repository's root: README.md or docs/PAGE.md
    line: int  # where it starts there
    kind: str  # "bash" or "python"
    text: str  # as pasted (continuation lines joined)
    run: str  # at digits scale


def at_digits_scale(command: str) -> str:
    for pattern, replacement, _ in SCALE:
        command = re.sub(pattern, replacement, command)
    if TRAINING.match(command) and not re.search(r"--rounds|--help|--quick", command):
        command += " --rounds 2"  # the default rounds are the benchmark's, minutes each
    return command


def _runnable_part(command: str) -> str:
    """The command less its `pip install` / pytest steps (see the module's docstring)."""
    steps = [s.strip() for s in command.split(" && ")]
    return " && ".join(s for s in steps if not s.startswith(NOT_RUN))


def guide_pages(mkdocs_yml: Path = REPO / "mkdocs.yml") -> list[Path]:
    """The documentation pages whose commands run, in the order of mkdocs.yml's `nav` (a page
    named twice runs once), less NOT_RUN_PAGES."""
    text = mkdocs_yml.read_text()
    nav = text[text.index("\nnav:") :]
    pages = re.findall(r"^\s+- (?:[^\n]*?: )?([\w./-]+\.md)\s*$", nav, flags=re.M)
    return [
        REPO / "docs" / page for page in dict.fromkeys(pages) if not page.startswith(NOT_RUN_PAGES)
    ]


def all_commands() -> list[Command]:
    """README.md's commands, then every guide page's, in the order they run."""
    commands = readme_commands()
    for page in guide_pages():
        commands += readme_commands(page)
    return commands


def readme_commands(readme: Path = REPO / "README.md") -> list[Command]:
    """The bash commands (one per logical line) and python blocks of one markdown file, in order,
    less the skipped blocks and the steps not run."""
    source = readme.relative_to(REPO).as_posix() if readme.is_relative_to(REPO) else str(readme)
    lines = readme.read_text().splitlines()
    commands: list[Command] = []
    i = 0
    while i < len(lines):
        fence = re.fullmatch(r"```(bash|python)", lines[i].strip())
        if not fence:
            i += 1
            continue
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        end = lines.index("```", i + 1)
        block, start = lines[i + 1 : end], i + 2
        i = end + 1
        if SKIP_MARK.search(previous):
            continue
        if fence[1] == "python":
            commands.append(Command(source, start, "python", "\n".join(block), "\n".join(block)))
            continue
        pending, first = "", start
        for n, raw in enumerate(block, start):
            if not pending:
                first = n
            if raw.rstrip().endswith("\\"):
                pending += raw.strip()[:-1].strip() + " "
                continue
            text = (pending + raw.strip()).strip()
            pending = ""
            code = text.split(" #")[0].strip() if not text.startswith("#") else ""
            runnable = _runnable_part(code)
            if runnable:
                commands.append(Command(source, first, "bash", text, at_digits_scale(runnable)))
    return commands


def git(*args: str | Path) -> str:
    """git's standard output (its errors go to this script's stderr; a failure raises)."""
    return subprocess.run(
        ["git", *map(str, args)], check=True, stdout=subprocess.PIPE, text=True
    ).stdout


def fresh_clone(destination: Path) -> None:
    """This commit, cloned: what a user gets, without this checkout's ignored outputs."""
    head = git("-C", REPO, "rev-parse", "HEAD").strip()
    git("init", "--quiet", destination)
    git("-C", destination, "fetch", "--quiet", "--depth", "1", REPO, head)
    git("-C", destination, "checkout", "--quiet", "FETCH_HEAD")


def run_all(commands: list[Command], clone: Path) -> int:
    env = {**os.environ, "PYTHONPATH": str(clone)}  # the clone's code, not this checkout's
    for c in commands:
        argv = (
            ["bash", "-o", "pipefail", "-c", c.run]
            if c.kind == "bash"
            else [sys.executable, "-c", c.run]
        )
        where = f"{c.source}:{c.line}"
        shown = c.run if c.kind == "bash" else f"python block at {where}"
        print(f"{where}: $ {shown}", flush=True)
        started = time.monotonic()
        done = subprocess.run(
            argv,
            cwd=clone,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if c.run == DEMO else None,
            text=True,
        )
        if c.run == DEMO:
            print(done.stdout, end="", flush=True)
            problems = (
                demo_differences((clone / "README.md").read_text(), done.stdout or "")
                if done.returncode == 0
                else []
            )
            if problems:
                print(
                    "readme.py: knnper demo printed a table outside the README's tolerance:\n"
                    + "\n".join(problems),
                    file=sys.stderr,
                )
                return 1
        print(f"{where}: exit {done.returncode} in {time.monotonic() - started:.0f} s", flush=True)
        if done.returncode != 0:
            print(f"readme.py: {where} failed: {c.text}", file=sys.stderr)
            return 1
    stray = git("-C", clone, "status", "--porcelain")
    if stray.strip():
        print(
            "readme.py: the documented commands left files that .gitignore does not cover:\n"
            + stray,
            file=sys.stderr,
        )
        return 1
    print(
        f"readme.py: all {len(commands)} commands of the README and the guides ran in a fresh clone"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="print the commands, run nothing")
    p.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="clone into this new directory and keep it (default: a temporary one)",
    )
    args = p.parse_args(argv)
    commands = all_commands()
    if args.list:
        for c in commands:
            print(f"{c.source}:{c.line}: {c.run if c.kind == 'bash' else '(python block)'}")
        return 0
    if args.keep is not None:
        fresh_clone(args.keep)
        return run_all(commands, args.keep)
    with tempfile.TemporaryDirectory(prefix="knnper-readme-") as tmp:
        fresh_clone(Path(tmp) / "knnper")
        return run_all(commands, Path(tmp) / "knnper")


if __name__ == "__main__":
    sys.exit(main())
