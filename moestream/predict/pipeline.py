"""Building a routing predictor for a loaded model, by name.

The provider wrapper that runs predictions (prefetch, predicted routing) and `attach` are in
experts/predicting.py."""

from __future__ import annotations

from moestream.config import ConfigError
from moestream.predict.base import PREDICTORS, Predictor


def make_predictor(name: str, model, *, heads=None, trace=None, ahead: int = 1) -> Predictor:
    """Build a predictor for a loaded model: heads = PrerouterHeads, trace = a Trace (oracle);
    ahead = how many layers ahead the stale gate names."""
    from moestream.predict.base import Predictor as NoPredictor
    from moestream.predict.oracle import OraclePredictor
    from moestream.predict.prerouter import PrerouterPredictor
    from moestream.predict.stale_gate import StaleGatePredictor
    from moestream.predict.temporal import TemporalPredictor

    blocks = model.moe_blocks
    if name == "none":
        return NoPredictor()
    if name == "temporal":
        return TemporalPredictor(len(blocks))
    if name == "stale-gate":
        # Ranked by router probability where every block's scores are probabilities.
        scorers = [b.scores for b in blocks] if all(b.scores_are_probs for b in blocks) else None
        return StaleGatePredictor([b.route for b in blocks], scorers, ahead)
    if name == "prerouter":
        if heads is None:
            raise ConfigError(
                "--predictor prerouter needs trained heads (prerouter.heads beside the "
                "model); make them with `moestream train-prerouter -m PATH --traces TRACE`"
            )
        if (len(heads.heads) + 1, heads.experts) != (len(blocks), model.args.num_experts):
            raise ConfigError("the prerouter heads were trained for another model shape")
        return PrerouterPredictor(heads)
    if name == "oracle":
        if trace is None:
            raise ConfigError("--predictor oracle replays a trace: pass --oracle-trace FOLDER")
        return OraclePredictor(trace)
    raise ConfigError(f"unknown --predictor {name!r}; use one of {', '.join(PREDICTORS)}")
