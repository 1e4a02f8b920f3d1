"""A Flower Grid without a network, for the ServerApp tests: each message goes to the ClientApp
in this process, each node a Context kept across messages as a SuperNode keeps it."""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from fed_train.flower.client_app import app as client_app


class InProcessGrid(Grid):
    """Each node is a Context; a node in `dead_after` stops answering after that many
    messages (as a SuperNode killed mid-run)."""

    def __init__(
        self, run_config: dict, node_configs: list[dict], dead_after: dict[int, int] | None = None
    ) -> None:
        self.contexts = {
            100 + i: Context(
                run_id=1,
                node_id=100 + i,
                node_config=cfg,
                state=RecordDict(),
                run_config=run_config,
            )
            for i, cfg in enumerate(node_configs)
        }
        self.budget = {100 + i: n for i, n in (dead_after or {}).items()}

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    # the rest of Grid's surface: the server app only sends and receives
    def set_run(self, run_id):  # pragma: no cover
        raise NotImplementedError

    @property
    def run(self):  # pragma: no cover
        raise NotImplementedError

    def create_message(self, *args, **kwargs):  # pragma: no cover
        raise NotImplementedError

    def push_messages(self, messages):  # pragma: no cover
        raise NotImplementedError

    def pull_messages(self, message_ids):  # pragma: no cover
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            if node in self.budget:
                if self.budget[node] == 0:
                    continue  # gone: no reply, the server's timeout passes
                self.budget[node] -= 1
            TaskIdentity.node_id = node
            try:
                replies.append(client_app(msg, self.contexts[node]))
            except Exception as err:  # what a SuperNode sends back for a raising ClientApp
                replies.append(
                    Message(Error(code=2, reason=f"{type(err)}:<'{err}'>"), reply_to=msg)
                )
            finally:
                TaskIdentity.node_id = 0
        return replies
