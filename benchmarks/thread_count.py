"""How many torch threads train the small CNN fastest: local SGD steps (batch 32, momentum 0.9) at
each thread count, for the input shapes of digits, Fashion-MNIST and CIFAR-10, each measurement
in a fresh process. The `knnper` default thread count is chosen from this table.

    python benchmarks/thread_count.py --out benchmarks/results/threads
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments import benchmark_support as C

CHILD = """
import json, sys, time
import torch
from fed_train.models import build_model
threads, steps, shape = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
torch.set_num_threads(threads)
torch.manual_seed(0)
spec = {"kind": "image", "shape": shape, "dtype": "uint8", "mean": [0.0] * shape[-1],
        "std": [1.0] * shape[-1]}
model = build_model("small-cnn", 10, spec)
opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
x = torch.randn(32, shape[-1], shape[0], shape[1])
y = torch.randint(0, 10, (32,))
def step():
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
for _ in range(5):
    step()
start = time.perf_counter()
for _ in range(steps):
    step()
print(json.dumps({"ms_per_step": 1000 * (time.perf_counter() - start) / steps}))
"""

SHAPES = {"digits": [8, 8, 1], "fashion-mnist": [28, 28, 1], "cifar10": [32, 32, 3]}


def main() -> None:
    p = C.script_parser(__doc__)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="counts to compare")
    p.add_argument("--steps", type=int, default=200, help="timed SGD steps per measurement")
    p.add_argument("--repeats", type=int, default=3, help="measurements per cell (median kept)")
    p.add_argument(
        "--data", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="input shapes to time"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/results/threads"),
        help="folder for threads.csv and threads.md",
    )
    args = p.parse_args()
    C.setup_logging()
    info = C.machine_info()
    rows = []
    for name in args.data:
        shape = SHAPES[name]
        row: dict = {"data": name, "shape": "x".join(map(str, shape))}
        for threads in args.threads:
            times = sorted(
                C.run_child(
                    CHILD, [str(threads), str(args.steps), json.dumps(shape)], threads=threads
                )["ms_per_step"]
                for _ in range(args.repeats)
            )
            row[f"ms_{threads}"] = times[len(times) // 2]
        best = min(args.threads, key=lambda t: row[f"ms_{t}"])
        row["fastest"] = best
        rows.append(row)
    columns = [("data", "data", ""), ("shape", "input", "")]
    columns += [(f"ms_{t}", f"ms/step, {t} thread(s)", ".2f") for t in args.threads]
    columns += [("fastest", "fastest", "")]
    args.out.mkdir(parents=True, exist_ok=True)
    C.write_csv(args.out / "threads.csv", rows, columns)
    table = C.markdown_table(rows, columns)
    (args.out / "threads.md").write_text(
        f"`{C.command_line()}`\n\n{C.machine_line(info)}\n\n{table}\n"
    )
    print(table)


if __name__ == "__main__":
    main()
