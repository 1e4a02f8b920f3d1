"""A Ctrl-C in the middle of an evaluation, for the tests that resume one."""

from __future__ import annotations


def interrupt_after(monkeypatch, algorithm_class, n: int) -> list[int]:
    """Make `algorithm_class.personalize` raise KeyboardInterrupt (a Ctrl-C) on its n+1-th call;
    returns the ids of the clients it personalized."""
    real, seen = algorithm_class.personalize, []

    def personalize(self, weights, client, state, seed):
        if len(seen) == n:
            raise KeyboardInterrupt
        seen.append(client.client_id)
        return real(self, weights, client, state, seed)

    monkeypatch.setattr(algorithm_class, "personalize", personalize)
    return seen
