"""An empty ClientApp and a ServerApp that sends it knnper's rounds: every training client gets
the model's weights each round and sends them straight back. The client side imports flwr only,
so a round here is what Flower itself costs (a process per message, polling, transport)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from flwr.app import Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

client = ClientApp()
server = ServerApp()


@client.train()
def echo(msg: Message, context: Context) -> Message:
    return Message(
        RecordDict({"arrays": msg.content["arrays"], "metrics": MetricRecord({"num-examples": 0})}),
        reply_to=msg,
    )


@server.main()
def rounds(grid: Grid, context: Context) -> None:
    from fed_train.flower.records import to_array_record
    from fed_train.flower.settings import FlowerSettings
    from fed_train.run import open_run

    settings = FlowerSettings.from_run_config(dict(context.run_config))
    run_dir = Path(settings.run_dir)
    run = open_run(settings.run, run_dir)
    arrays = to_array_record(run.start)
    training = int((~run.partition.unseen.astype(bool)).sum())
    deadline = time.monotonic() + settings.connect_timeout
    while len(grid.get_node_ids()) < settings.run.clients and time.monotonic() < deadline:
        time.sleep(1.0)
    nodes = sorted(grid.get_node_ids())[:training]
    with open(run_dir / "metrics.jsonl", "w") as log:
        for r in range(1, settings.run.training.rounds + 1):
            start = time.perf_counter()
            replies = list(
                grid.send_and_receive(
                    [
                        Message(
                            RecordDict({"arrays": arrays}),
                            dst_node_id=n,
                            message_type=MessageType.TRAIN,
                            group_id=str(r),
                        )
                        for n in nodes
                    ],
                    timeout=settings.round_timeout,
                )
            )
            ok = sum(not reply.has_error() for reply in replies)
            log.write(
                json.dumps(
                    {"round": r, "clients": ok, "seconds": round(time.perf_counter() - start, 3)}
                )
                + "\n"
            )
            log.flush()
    status = "completed" if ok == len(nodes) else "failed"
    (run_dir / "flower.json").write_text(json.dumps({"status": status, "nodes": len(nodes)}))
