"""How soon each `knnper` command answers: whole processes of the installed console script,
timed from spawning it to the first line it prints (stdout or stderr), with the process's own
CPU time (user + sys), over --repeats runs each (min / median / max).

    flock /tmp/knnper-bench.lock python benchmarks/cli_start.py \
        --out benchmarks/results/cli_start [--tree before=/tmp/before] [--tree now=.]

Every --tree is a source tree put first on PYTHONPATH (the console scripts import from it), so
two versions are timed in one run, interleaved command by command (what the machine's other
jobs cost one, they cost the other). Target (issue 49): --help, --version and an argument error
answered in at most 0.5 s, median of 5, with no torch imported (tests/test_cli_start.py checks
that by the modules loaded). On a shared machine the wall clock includes waiting for a core:
the load average is recorded beside each figure and the CPU time is the steadier measure.
Outputs in OUT: samples.csv (every process), start.csv (the summary), start.md, run.json.
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments import benchmark_support as C

TARGET_S = 0.5
# case -> (console script, its arguments, whether the target applies); RUN and OUT are filled in
CASES: dict[str, tuple[str, tuple[str, ...], bool]] = {
    "--help": ("knnper", ("--help",), True),
    "--version": ("knnper", ("--version",), True),
    "argument error (export --budget banana)": (
        "knnper",
        ("export", "RUN", "--out", "OUT", "--budget", "banana"),
        True,
    ),
    "unknown command": ("knnper", ("expotr",), True),
    "export --help": ("knnper", ("export", "--help"), False),
    "knnper-edge --help": ("knnper-edge", ("--help",), False),
}
SAMPLE_COLUMNS = ("tree", "case", "repeat", "first_line_s", "wall_s", "cpu_s", "exit", "load")
SUMMARY = [
    ("tree", "tree", ""),
    ("case", "command", ""),
    ("runs", "runs", ""),
    ("first_min", "first line min s", ".3f"),
    ("first_median", "first line median s", ".3f"),
    ("first_max", "first line max s", ".3f"),
    ("cpu_min", "CPU min s", ".3f"),
    ("cpu_median", "CPU median s", ".3f"),
    ("cpu_max", "CPU max s", ".3f"),
    ("load_median", "load average", ".2f"),
    ("target", "target", ""),
]


def script(name: str) -> str:
    """The console script installed beside this interpreter (not a version manager's shim,
    whose own start would be timed too)."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise SystemExit(f"cli_start: no {name} console script (pip install -e .)")
    return found


def time_one(argv: list[str], tree: Path) -> dict[str, float]:
    """One process: seconds to its first line and to its end, its CPU seconds, its exit code."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tree
    )
    assert proc.stdout is not None
    proc.stdout.readline()
    first = time.perf_counter() - start
    proc.stdout.read()
    code = proc.wait(timeout=600)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"first_line_s": first, "wall_s": wall, "cpu_s": cpu, "exit": code}


def summarize(samples: list[dict]) -> list[dict]:
    """Per tree and case: min / median / max of the first line and of the CPU time, the median
    load average, and the target's verdict (by the median first line)."""
    rows = []
    for tree in dict.fromkeys(s["tree"] for s in samples):
        for case, (_, _, targeted) in CASES.items():
            mine = [s for s in samples if s["tree"] == tree and s["case"] == case]
            if not mine:
                continue
            first = [s["first_line_s"] for s in mine]
            cpu = [s["cpu_s"] for s in mine]
            median = statistics.median(first)
            verdict = ("met" if median <= TARGET_S else "missed") if targeted else "-"
            rows.append(
                {
                    "tree": tree,
                    "case": case,
                    "runs": len(mine),
                    "first_min": min(first),
                    "first_median": median,
                    "first_max": max(first),
                    "cpu_min": min(cpu),
                    "cpu_median": statistics.median(cpu),
                    "cpu_max": max(cpu),
                    "load_median": statistics.median(s["load"] for s in mine),
                    "target": verdict,
                }
            )
    return rows


def main() -> None:
    p = C.script_parser(__doc__)
    p.add_argument("--out", type=Path, required=True, help="folder for the results")
    p.add_argument("--repeats", type=int, default=5, help="processes per command and tree")
    p.add_argument(
        "--tree",
        action="append",
        default=None,
        metavar="LABEL=PATH",
        help="a source tree to time (repeatable; default: now=this repository)",
    )
    args = p.parse_args()
    trees = {
        label: Path(path).resolve()
        for label, _, path in (t.partition("=") for t in args.tree or [f"now={C.REPO}"])
    }
    started, machine = C.start_benchmark(args.out, threads=1)
    samples = []
    with tempfile.TemporaryDirectory(prefix="knnper-cli-start-") as tmp:
        fill = {"RUN": str(Path(tmp) / "run"), "OUT": str(Path(tmp) / "out")}
        commands = {
            case: [script(name), *(fill.get(a, a) for a in argv)]
            for case, (name, argv, _) in CASES.items()
        }
        for repeat in range(-1, args.repeats):  # round -1 warms the file cache, untimed
            for case, argv in commands.items():
                for label, tree in trees.items():
                    load = C.load_average()
                    timed = time_one(argv, tree)
                    if repeat >= 0:
                        samples.append(
                            {"tree": label, "case": case, "repeat": repeat, "load": load, **timed}
                        )
    rows = summarize(samples)
    end = C.machine_info()
    head = C.report_head(
        "Time to a command's first line",
        machine,
        end,
        f"Whole processes of the installed console scripts, {args.repeats} per command and "
        f"tree, interleaved; target {TARGET_S} s median for --help, --version and argument "
        "errors. The CPU time is the process's user + sys.",
    )
    C.write_results(
        args,
        started,
        C.report_text(head, C.markdown_table(rows, SUMMARY)),
        report="start.md",
        record="run.json",
        tables={"samples.csv": (samples, SAMPLE_COLUMNS), "start.csv": (rows, SUMMARY)},
        machine=machine,
        machine_end=end,
        trees={label: str(path) for label, path in trees.items()},
    )


if __name__ == "__main__":
    main()
