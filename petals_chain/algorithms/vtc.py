"""Virtual Token Counter (papers/vtc-fairness-in-serving-llms.txt, Algorithm 2): the one
implementation of its counters, used by a block server's `vtc` scheduling policy
(`server/policies.py`: per step, per authenticated client) and by `petals-chain api --admission
vtc` (`petals_chain/api/admission.py`: per request, per API key). Here because both may import
`petals_chain` (the client side never imports `server/`).

One counter per client. A client that becomes active is lifted to the smallest counter of the
active clients, or, when none is active, to the counter of the client that left last (lines 7-13:
idle time earns no credit); the next work goes to the active client with the smallest counter;
a client is charged `w_in` per input (prefill) token and `w_out` per output (decode) token as its
work is scheduled (lines 24, 30). Two backlogged clients' service then differs by at most
2 max(w_in L_input, w_out M) (Theorem 4.4).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable


class VirtualTokenCounters:
    def __init__(self, w_in: float = 1.0, w_out: float = 2.0):
        if w_in < 0 or w_out < 0 or (w_in <= 0 and w_out <= 0):
            raise ValueError("VTC needs w_in, w_out >= 0 and one of them > 0, otherwise no counter ever moves")
        self.w_in, self.w_out = float(w_in), float(w_out)
        self.counters: dict[str, float] = {}
        self.served: dict[str, float] = {}  # weighted tokens actually charged (never lifted)
        self.last_left: str | None = None  # the client that went inactive last

    def lift(self, client: str, active: Collection[str]) -> None:
        """`client` becomes active while `active` (other clients) are: lines 7-13."""
        c = self.counters.get(client, 0.0)
        others = [a for a in active if a != client]
        if others:
            c = max(c, min(self.counters.get(a, 0.0) for a in others))
        elif self.last_left is not None:
            c = max(c, self.counters.get(self.last_left, 0.0))
        self.counters[client] = c

    def left(self, client: str) -> None:
        """`client` has nothing waiting or running any more."""
        self.last_left = client

    def cost(self, input_tokens: int = 0, output_tokens: int = 0) -> float:
        return self.w_in * input_tokens + self.w_out * output_tokens

    def charge(self, client: str, input_tokens: int = 0, output_tokens: int = 0) -> float:
        """Charge `client` for work as it is scheduled; returns the charge."""
        charge = self.cost(input_tokens, output_tokens)
        self.counters[client] = self.counters.get(client, 0.0) + charge
        self.served[client] = self.served.get(client, 0.0) + charge
        return charge

    def pick(self, clients: Iterable[str], tiebreak: Callable[[str], Hashable] = lambda c: 0) -> str:
        """The client with the smallest counter (ties: the smallest `tiebreak`, e.g. oldest work)."""
        return min(clients, key=lambda c: (self.counters.get(c, 0.0), tiebreak(c)))
