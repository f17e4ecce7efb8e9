"""An eager stand-in for engine/graph.py's DecodeGraph on the CPU: the launch / read / step
contract of a captured greedy step that feeds its pick back, so the generator's run-ahead loop
(`Generator._ahead`) and the providers' decode hooks can be tested without a GPU."""

from __future__ import annotations

import torch


class EagerAhead:
    """DecodeGraph's launch / read / step contract run eagerly on the CPU: each step's greedy
    pick becomes the next step's input unless a token is given, results come back through
    AHEAD buffers. Records the launches so the generator's bookkeeping can be checked."""

    def __init__(self, model, cache, log):
        self.model, self.cache, self.log = model, cache, log
        self.tok, self.buf, self.inflight = None, {}, 0

    def _forward(self, pos):
        with torch.no_grad():
            return self.model(torch.tensor([self.tok]), self.cache, pos, last_only=True)[-1]

    def step(self, token, pos):
        self.tok = token
        return self._forward(pos)

    def launch(self, pos, token=None):
        from moestream.engine.sampling import device_greedy

        if token is not None:
            self.tok = token
        tok, lp = device_greedy(self._forward(pos)).tolist()
        self.tok = int(tok)
        j = pos % 2
        assert j not in self.buf, "a result buffer reused before it was read"
        self.buf[j] = (int(tok), lp)
        self.inflight += 1
        self.log.append((pos, token, self.inflight))
        return j

    def read(self, j):
        self.inflight -= 1
        return self.buf.pop(j)


class AheadGraphs:
    def __init__(self, model, args, log):
        self.model, self.args, self.log = model, args, log

    def for_length(self, total):
        from moestream.engine.kv_cache import KVCache

        return EagerAhead(self.model, KVCache(self.args, total, torch.float32), self.log)
